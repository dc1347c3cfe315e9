package limits

import (
	"context"
	_ "embed"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"time"
)

// Prefill isolation (docs/traffic.md, "Prefill isolation"): a model
// group that keeps K of its N deployments free of agent and batch prefill
// at every moment, fleet-wide. Every proxy's prefill entries of the group
// live under the group's own hash tag, {g:<hash of the group>}, so the
// check across the group's deployments is one script call on one Redis
// Cluster slot (lua/gate.lua):
//
//	<prefix>{g:<hash>}:gate    entries (zset): '<kind>|<deployment>|<request>' scored by expiry (ms)
//	<prefix>{g:<hash>}:runs    each deployment's current run of agent prefill: its start (ms) (hash)
//
// Entries expire like leases: an entry lives one lease TTL unless
// renewed, so a lost proxy's entries stop counting one TTL after its last
// renewal.

//go:embed lua/gate.lua
var gateLua string

var gateScript = newScript(gateLua)

// GateJoinWindow is how long a deployment's run of agent prefill takes
// more agent prefill: a deployment whose run began longer ago is refused
// (GateRunTooLong) until the run ends, so agent prefill cannot stay on
// one deployment forever while requests wait for another one.
const GateJoinWindow = 2 * time.Second

// GateRetryAfter is the retry-after of a request refused by the gate:
// entries end at first tokens, which no lease expiry tells.
const GateRetryAfter = PrefillRetryAfter

// Reasons a non-interactive request may not start prefill on a deployment.
const (
	// GateInteractive: the deployment has interactive prefill in flight.
	GateInteractive = "interactive"
	// GateIsolation: N − K other deployments have agent prefill in flight.
	GateIsolation = "isolation"
	// GateRunTooLong: the deployment's run of agent prefill began more
	// than GateJoinWindow ago.
	GateRunTooLong = "run"
)

// GateEntry is a request's prefill registered at a group's gate.
type GateEntry struct {
	keys   [2]string
	member string
	// Deployment is the deployment the entry holds prefill on.
	Deployment string
}

// gateKeys are a group's gate keys.
func (l *Limiter) gateKeys(group string) [2]string {
	h := fnv.New64a()
	_, _ = h.Write([]byte(group))
	base := l.cfg.KeyPrefix + "{g:" + strconv.FormatUint(h.Sum64(), 16) + "}:"
	return [2]string{base + "gate", base + "runs"}
}

func gateArgs(op string, ttl time.Duration, member string) *argv {
	a := newArgv()
	a.str(op)
	a.int(max(ms(ttl), 1))
	a.str(member)
	return a
}

func validGateID(kind, id string) error {
	if id == "" || strings.Contains(id, "|") {
		return fmt.Errorf("%w: gate %s %q", ErrInvalidRequest, kind, id)
	}
	return nil
}

// GateEnter registers a non-interactive request's prefill on deployment
// dep of group when the gate allows it (most: the most deployments of the
// group with agent prefill at once, N − K, at least 1): dep already has
// agent prefill in flight (its run younger than GateJoinWindow) or fewer
// than most deployments have, and dep has no interactive prefill in
// flight. refused names the reason (Gate constants) when it does not.
func (l *Limiter) GateEnter(ctx context.Context, group, dep, requestID string, most int) (e *GateEntry, refused string, err error) {
	if err := validGateID("deployment", dep); err != nil {
		return nil, "", err
	}
	keys := l.gateKeys(group)
	a := gateArgs("enter", l.cfg.LeaseTTL, requestID)
	defer a.release()
	a.str(dep)
	a.int(int64(max(most, 1)))
	a.int(ms(GateJoinWindow))
	v, err := l.run(ctx, gateScript, "gate", keys[:], a)
	if err != nil {
		return nil, "", err
	}
	if len(v) == 1 && v[0] == 1 {
		return &GateEntry{keys: keys, member: "a|" + dep + "|" + requestID, Deployment: dep}, "", nil
	}
	if len(v) != 2 {
		return nil, "", fmt.Errorf("limits gate: %d values", len(v))
	}
	switch v[1] {
	case 1:
		return nil, GateInteractive, nil
	case 2:
		return nil, GateIsolation, nil
	}
	return nil, GateRunTooLong, nil
}

// GatePlace registers an interactive request's prefill on the first of
// deps (the candidates in order) without agent prefill in flight, or on
// the first when every one has some, and returns its index and whether it
// had none. Agent and batch prefill does not start on it until the entry
// leaves (GateLeave, at the request's first token).
func (l *Limiter) GatePlace(ctx context.Context, group, requestID string, deps []string) (e *GateEntry, idx int, free bool, err error) {
	if len(deps) == 0 {
		return nil, 0, false, fmt.Errorf("%w: gate place without candidates", ErrInvalidRequest)
	}
	keys := l.gateKeys(group)
	a := gateArgs("place", l.cfg.LeaseTTL, requestID)
	defer a.release()
	a.int(int64(len(deps)))
	for _, d := range deps {
		if err := validGateID("deployment", d); err != nil {
			return nil, 0, false, err
		}
		a.str(d)
	}
	v, err := l.run(ctx, gateScript, "gate", keys[:], a)
	if err != nil {
		return nil, 0, false, err
	}
	if len(v) != 2 || v[0] < 1 || int(v[0]) > len(deps) {
		return nil, 0, false, fmt.Errorf("limits gate place: unexpected answer %v", v)
	}
	i := int(v[0]) - 1
	return &GateEntry{keys: keys, member: "i|" + deps[i] + "|" + requestID, Deployment: deps[i]}, i, v[1] == 1, nil
}

// GateRenew moves the entry's expiry one lease TTL ahead; live is false
// when it had expired (it is not revived: other requests may have started
// prefill relying on its end).
func (l *Limiter) GateRenew(ctx context.Context, e *GateEntry) (live bool, err error) {
	a := gateArgs("renew", l.cfg.LeaseTTL, e.member)
	defer a.release()
	v, err := l.run(ctx, gateScript, "gate", e.keys[:], a)
	if err != nil {
		return false, err
	}
	return len(v) == 1 && v[0] == 1, nil
}

// GateLeave removes the entry (first token, or the attempt ended).
func (l *Limiter) GateLeave(ctx context.Context, e *GateEntry) error {
	a := gateArgs("leave", l.cfg.LeaseTTL, e.member)
	defer a.release()
	_, err := l.run(ctx, gateScript, "gate", e.keys[:], a)
	return err
}
