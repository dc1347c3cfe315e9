package limits

import (
	"strings"
	"sync"
)

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
//	<prefix>{o:<org>}:leases               the org's lease index (zset; lease.go)
//
// lua/common.lua lists the fields of the lim hash. The budget fields name
// their window and budget_duration, so changing budget_duration starts a
// new counter (seeded from the ledger, seed.go) instead of reinterpreting
// the old one.
//
// Layout history: until 2026-11 each scope had four keys (rpm:, tpm:,
// par:, bud:<window>:); a data plane of this layout does not read them, so
// an upgrade restarts rate windows empty and budgets from the ledger
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

// leaseIndex is the org's index of sweepable requests: request id scored
// by lease expiry (ms).
func (k keyBuilder) leaseIndex() string { return k.base + "leases" }

// budgetLeaseIndex is the org's index of scopes holding budget leases of
// quota slices: state hash key scored by its earliest lease expiry (ms),
// so a sweeper reclaims expired leases no call of the scope reclaims.
func (k keyBuilder) budgetLeaseIndex() string { return k.base + "bhx" }

// scope returns the state and leases keys of s, in script order.
func (k keyBuilder) scope(s *Scope) [keysPerScope]string {
	tail := s.Kind + ":" + s.ID
	return [keysPerScope]string{k.base + "lim:" + tail, k.base + "par:" + tail}
}

// callKeys returns KEYS for a script call on req's scopes: epoch, record,
// the scopes' keys, then the org's lease index.
func (k keyBuilder) callKeys(requestID string, scopes []Scope) []string {
	keys := make([]string, 0, 3+keysPerScope*len(scopes))
	keys = append(keys, k.epoch(), k.record(requestID))
	for i := range scopes {
		sk := k.scope(&scopes[i])
		keys = append(keys, sk[:]...)
	}
	return append(keys, k.leaseIndex())
}

// validTagPart reports whether s can sit inside a hash tag or key without
// changing which part of the key Redis Cluster hashes.
func validTagPart(s string) bool {
	return s != "" && !strings.ContainsAny(s, "{}")
}

// DeploymentLeaseKey is the key of a deployment's fleet-wide
// max_concurrency leases (a zset of request ids scored by lease expiry in
// ms): its live count is the deployment's fleet-wide in-flight load,
// which load-aware routing reads (package affinity).
func (l *Limiter) DeploymentLeaseKey(deploymentID string) string {
	kb := newKeyBuilder(l.cfg.KeyPrefix, DeploymentOrg(deploymentID))
	return kb.scope(&Scope{Kind: KindDeployment, ID: deploymentID})[1]
}

// DeploymentPrefillKey is the hash holding a deployment's fleet-wide
// prefill tokens in flight in field PrefillField (lua/common.lua,
// "Prefill accounting"), for requests admitted with a Prefill on the
// deployment's max_concurrency scope. The value counts expired leases of
// a lost proxy until the next admission on the deployment prunes them.
func (l *Limiter) DeploymentPrefillKey(deploymentID string) string {
	kb := newKeyBuilder(l.cfg.KeyPrefix, DeploymentOrg(deploymentID))
	return kb.scope(&Scope{Kind: KindDeployment, ID: deploymentID})[0]
}

// PrefillField is the field of a prefill scope's state hash holding its
// prefill tokens in flight.
const PrefillField = "pt"

// keyCache holds the keys of the orgs and scopes seen (the hot path builds
// the same ones for every request of a scope), up to maxCachedKeys entries
// (then it starts over).
type keyCache struct {
	mu     sync.RWMutex
	scopes map[sliceKey][keysPerScope]string
	orgs   map[string][2]string // epoch, lease index
}

const maxCachedKeys = 1 << 16

func (c *keyCache) org(prefix, org string) [2]string {
	c.mu.RLock()
	v, ok := c.orgs[org]
	c.mu.RUnlock()
	if ok {
		return v
	}
	kb := newKeyBuilder(prefix, org)
	v = [2]string{kb.epoch(), kb.leaseIndex()}
	c.mu.Lock()
	if c.orgs == nil || len(c.orgs) >= maxCachedKeys {
		c.orgs = make(map[string][2]string)
	}
	c.orgs[org] = v
	c.mu.Unlock()
	return v
}

func (c *keyCache) scope(prefix, org string, s *Scope) [keysPerScope]string {
	k := sliceKey{org, s.Kind, s.ID}
	c.mu.RLock()
	v, ok := c.scopes[k]
	c.mu.RUnlock()
	if ok {
		return v
	}
	v = newKeyBuilder(prefix, org).scope(s)
	c.mu.Lock()
	if c.scopes == nil || len(c.scopes) >= maxCachedKeys {
		c.scopes = make(map[sliceKey][keysPerScope]string)
	}
	c.scopes[k] = v
	c.mu.Unlock()
	return v
}

// callKeys is keyBuilder.callKeys with the org's and scopes' keys cached.
func (l *Limiter) callKeys(org, requestID string, scopes []Scope) []string {
	ok := l.keys.org(l.cfg.KeyPrefix, org)
	keys := make([]string, 0, 3+keysPerScope*len(scopes))
	keys = append(keys, ok[0], l.cfg.KeyPrefix+"{o:"+org+"}:req:"+requestID) // keyBuilder.record
	for i := range scopes {
		sk := l.keys.scope(l.cfg.KeyPrefix, org, &scopes[i])
		keys = append(keys, sk[:]...)
	}
	return append(keys, ok[1])
}
