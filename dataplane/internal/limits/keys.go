package limits

import "strings"

// Key layout. Every key of one script call is built here and carries the
// request's org hash tag, {o:<org>}, so that one call touches one Redis
// Cluster slot. The variable part (a scope ID, which may contain ':') always
// comes last, after parts drawn from fixed sets, so two different scopes
// never share a key.
//
//	<prefix>{o:<org>}:epoch                epoch (string, ms)
//	<prefix>{o:<org>}:req:<request id>     request record (string)
//	<prefix>{o:<org>}:lim:<kind>:<id>      the scope's rpm and tpm windows and budget (hash)
//	<prefix>{o:<org>}:par:<kind>:<id>      the scope's leases (zset)
//
// lua/common.lua lists the fields of the lim hash. The budget fields name
// their window and budget_duration, so changing budget_duration starts a
// new counter (from its seed) instead of reinterpreting the old one.
//
// Layout history: until 2026-11 each scope had four keys (rpm:, tpm:,
// par:, bud:<window>:); a data plane of this layout does not read them, so
// an upgrade restarts rate windows empty and budgets from their seeds
// (docs/limits.md, "Upgrades").

// keysPerScope is the number of KEYS each scope occupies in a script call.
const keysPerScope = 2

// keyBuilder builds the keys of one org.
type keyBuilder struct {
	base string // "<prefix>{o:<org>}:"
}

func newKeyBuilder(prefix, org string) keyBuilder {
	return keyBuilder{base: prefix + "{o:" + org + "}:"}
}

func (k keyBuilder) epoch() string { return k.base + "epoch" }

func (k keyBuilder) record(requestID string) string { return k.base + "req:" + requestID }

// scope returns the state and leases keys of s, in script order.
func (k keyBuilder) scope(s *Scope) [keysPerScope]string {
	tail := s.Kind + ":" + s.ID
	return [keysPerScope]string{k.base + "lim:" + tail, k.base + "par:" + tail}
}

// callKeys returns KEYS for a script call on req's scopes.
func (k keyBuilder) callKeys(requestID string, scopes []Scope) []string {
	keys := make([]string, 0, 2+keysPerScope*len(scopes))
	keys = append(keys, k.epoch(), k.record(requestID))
	for i := range scopes {
		sk := k.scope(&scopes[i])
		keys = append(keys, sk[:]...)
	}
	return keys
}

// validTagPart reports whether s can sit inside a hash tag or key without
// changing which part of the key Redis Cluster hashes.
func validTagPart(s string) bool {
	return s != "" && !strings.ContainsAny(s, "{}")
}
