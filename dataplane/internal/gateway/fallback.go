package gateway

import (
	"fmt"
	"strings"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/routing"
)

// Fallbacks (SPEC §7.3, docs/resilience.md "Fallbacks"): after the
// requested group's candidates come those of its fallback groups, in
// order (routing.FallbackChain: the key's override, the team's, the
// group's list). Every fallback group passes the filters of the primary:
// the permissions of every level, the route's protocol, the request's
// capabilities (tools, JSON mode, vision, input and output tokens), the
// key's tag pool and health. A group that cannot serve the request is
// skipped and the reason kept for the answer; it is never used with the
// request degraded. The candidates of all groups share the request's one
// attempt budget, retry budget and total deadline (forward.go).

// segment is the candidates of one model group of the chain.
type segment struct {
	group string
	cands []candidate
	// down: every deployment of the group is ejected, parked or failing
	// its health check right now (InRotation brought some back).
	down bool
}

// candidateChain resolves the requested group and its fallbacks into one
// ordered candidate list: the first group that has a deployment in
// rotation, then the others in chain order, groups entirely down last.
// It returns the segment routed first (affinity orders it) and the rest
// appended after. A refusal of the primary that no fallback fixes is the
// answer, with the skipped fallbacks named.
func (x *exchange) candidateChain(cat *catalog.Catalog) (first, rest []candidate, _ *openai.Error) {
	deps, e := x.resolve(cat) // unknown model, not allowed, enforced params: no fallback
	if e != nil {
		return nil, nil, e
	}
	chain := routing.FallbackChain(x.p, x.group, cat.ModelGroup)
	primary, perr := x.groupCandidates(cat, x.group, deps)
	if len(chain) == 0 {
		return primary, nil, perr
	}
	now := time.Now()
	segs := make([]segment, 0, 1+len(chain))
	if perr == nil {
		segs = append(segs, segment{x.group, primary, allDown(primary, now)})
	} else {
		x.skipped = append(x.skipped, skippedGroup{x.group, perr.Message})
	}
	for _, g := range chain {
		if !cat.HasModelGroup(g) {
			x.skipped = append(x.skipped, skippedGroup{g, "it no longer exists"})
			continue
		}
		deps, ok := routing.AllowedDeployments(x.p, x.cust, g, cat.Deployments(g))
		if !ok {
			x.skipped = append(x.skipped, skippedGroup{g, "this key may not use it"})
			continue
		}
		cands, e := x.groupCandidates(cat, g, deps)
		if e != nil {
			x.skipped = append(x.skipped, skippedGroup{g, e.Message})
			continue
		}
		segs = append(segs, segment{g, cands, allDown(cands, now)})
	}
	if len(segs) == 0 {
		if perr == nil {
			perr = openai.Unavailable(openai.CodeNoHealthyDeployment, fmt.Sprintf("model %q has no usable deployment right now", x.group), 5*time.Second)
		}
		return nil, nil, x.withSkipped(perr)
	}
	// Groups with a deployment in rotation first, in chain order; groups
	// entirely down after them (still tried: ejections never empty a pool).
	ordered := make([]segment, 0, len(segs))
	for _, s := range segs {
		if !s.down {
			ordered = append(ordered, s)
		}
	}
	for _, s := range segs {
		if s.down {
			ordered = append(ordered, s)
		}
	}
	for _, s := range ordered[1:] {
		rest = append(rest, s.cands...)
	}
	return ordered[0].cands, rest, nil
}

// groupCandidates runs the filters of one group's permitted deployments:
// the route's protocol, then capabilities, tag pool and health.
func (x *exchange) groupCandidates(cat *catalog.Catalog, group string, deps []*catalog.Deployment) ([]candidate, *openai.Error) {
	deps, e := x.protocolDeployments(group, deps)
	if e != nil {
		return nil, e
	}
	return x.h.candidates(cat, x.route, x.req, x.p, group, deps)
}

// allDown reports whether no candidate of a group is healthy at now.
func allDown(cands []candidate, now time.Time) bool {
	for _, c := range cands {
		if !c.st.Health.Ejected(now) {
			return false
		}
	}
	return true
}

// skippedGroup is a group of the chain that could not serve the request.
type skippedGroup struct{ group, why string }

// withSkipped names the groups of the chain that were skipped in e's
// message, so a client learns why no fallback served its request.
func (x *exchange) withSkipped(e *openai.Error) *openai.Error {
	if e == nil || len(x.skipped) == 0 {
		return e
	}
	var b strings.Builder
	b.WriteString(e.Message)
	for _, s := range x.skipped {
		if s.group == x.group && strings.Contains(e.Message, s.why) {
			continue
		}
		fmt.Fprintf(&b, "; model group %q skipped: %s", s.group, s.why)
	}
	out := *e
	out.Message = b.String()
	return &out
}
