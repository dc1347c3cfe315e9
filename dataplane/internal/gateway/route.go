package gateway

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/routing"
	"github.com/sluicegw/sluice/dataplane/internal/upstream"
)

// candidate is a deployment that may serve the request, with its
// runtime state.
type candidate struct {
	d  *catalog.Deployment
	st *upstream.State
	// standing is the deployment's place for this request (healthy,
	// probe, last resort), from the health at candidate time.
	standing upstream.Standing
}

// candidates returns the deployments that may serve req, in the order to
// try them: capability filters (none left: 400 unsupported_parameter
// naming the parameter), deployments whose credential cannot be decrypted
// removed (reported), the key's tag pool, health, then a weighted shuffle
// of the healthy ones followed by the last resorts (byStanding).
func (h *Handler) candidates(cat *catalog.Catalog, route string, req *openai.Request, p *catalog.Principal, group string, deps []*catalog.Deployment) ([]candidate, *openai.Error) {
	deps, e := routing.Filter(group, routing.RequirementsOf(route, req), deps)
	if e != nil {
		return nil, e
	}
	usable := make([]*catalog.Deployment, 0, len(deps))
	for _, d := range deps {
		if d.CredentialErr != nil {
			h.reportCredentialError(d)
			continue
		}
		usable = append(usable, d)
	}
	if len(usable) == 0 {
		return nil, openai.Unavailable(openai.CodeNoHealthyDeployment,
			fmt.Sprintf("model %q has no usable deployment right now", group), 5*time.Second)
	}
	usable = routing.TagPool(usable, p.Key.GetTags())
	sts := make([]*upstream.State, len(usable))
	for i, d := range usable {
		sts[i] = h.states.Get(d.GetId())
	}
	// Health: ejected and parked deployments are skipped, at most
	// MaxEjectionPercent of the pool (never all of it); those the cap
	// keeps in are a last resort, after every healthy one (parked ones
	// after every other); past the panic threshold (the group's, else
	// --panic-threshold) every deployment is routed to as healthy.
	panicPct := h.panicPct
	if n := cat.ModelGroup(group).GetResilience().GetPanicThresholdPercent(); n > 0 {
		panicPct = int(n)
	}
	now := time.Now()
	stand := upstream.Standings(sts, now, h.maxEjectionPct, panicPct)
	cands := make([]candidate, 0, len(usable))
	for i, d := range usable {
		switch stand[i] {
		case upstream.Excluded:
			continue
		case upstream.Healthy, upstream.Probe:
			h.countReturn(d, sts[i])
		}
		cands = append(cands, candidate{d, sts[i], stand[i]})
	}
	// The share of the pool out of rotation for this request (at most
	// the maximum ejection percentage unless the pool is a single one).
	h.poolOutSeries(group).Set(float64(len(usable)-len(cands)) / float64(len(usable)))
	routing.WeightedShuffle(cands, func(c candidate) int64 { return int64(c.d.GetWeight()) })
	byStanding(cands)
	return cands, nil
}

// byStanding orders candidates by their standing's rank, keeping the
// order (weights, affinity) of the healthy ones and putting the last
// resorts of each rank soonest back first.
func byStanding(cands []candidate) {
	slices.SortStableFunc(cands, func(a, b candidate) int {
		ra, rb := a.standing.Rank(), b.standing.Rank()
		if ra != rb {
			return cmp.Compare(ra, rb)
		}
		if ra == 0 {
			return 0
		}
		return a.st.Health.EjectedUntil().Compare(b.st.Health.EjectedUntil())
	})
}

// chainOrder is the order a request tries its candidates in: the best
// standing of its first group (best) ordered by affinity or load, then
// the rest of that group and the fallback groups' candidates, the
// healthy ones of every group before the last resorts of any.
func (x *exchange) chainOrder(cat *catalog.Catalog, best, rest, fallbacks []candidate) []candidate {
	rest = slices.Concat(rest, fallbacks)
	byStanding(rest)
	return append(x.orderCandidates(cat, best), rest...)
}

// bestStanding splits candidates ordered by byStanding into those of the
// best rank present (what affinity and load order) and the rest.
func bestStanding(cands []candidate) (best, rest []candidate) {
	for i, c := range cands {
		if c.standing.Rank() != cands[0].standing.Rank() {
			return cands[:i:i], cands[i:]
		}
	}
	return cands, nil
}

// reportCredentialError logs a deployment's credential error once per
// distinct error and counts every request that found it unusable.
func (h *Handler) reportCredentialError(d *catalog.Deployment) {
	h.m.credentialErrors.WithLabelValues(d.GetId()).Inc()
	msg := d.CredentialErr.Error()
	if !h.states.Get(d.GetId()).FirstCredentialError(msg) {
		return
	}
	h.log.Error("deployment unavailable: its upstream credential cannot be decrypted",
		"deployment", d.GetId(), "model_group", d.GetModelGroup(), "error", msg)
}
