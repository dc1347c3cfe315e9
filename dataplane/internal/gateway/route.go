package gateway

import (
	"fmt"
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
}

// candidates returns the deployments that may serve req, in the order to
// try them: capability filters (none left: 400 unsupported_parameter
// naming the parameter), deployments whose credential cannot be decrypted
// removed (reported), the key's tag pool, health, then a weighted shuffle.
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
	// MaxEjectionPercent of the pool (never all of it); past the panic
	// threshold (the group's, else --panic-threshold) none is.
	panicPct := h.panicPct
	if n := cat.ModelGroup(group).GetResilience().GetPanicThresholdPercent(); n > 0 {
		panicPct = int(n)
	}
	now := time.Now()
	in := upstream.InRotationPanic(sts, now, h.maxEjectionPct, panicPct)
	for i, st := range sts {
		if in[i] && !st.Health.Ejected(now) {
			h.countReturn(usable[i], st)
		}
	}
	cands := make([]candidate, 0, len(usable))
	for i, d := range usable {
		if in[i] {
			cands = append(cands, candidate{d, sts[i]})
		}
	}
	// The share of the pool out of rotation for this request (at most
	// the maximum ejection percentage unless the pool is a single one).
	h.m.poolOut.WithLabelValues(group).Set(float64(len(usable)-len(cands)) / float64(len(usable)))
	routing.WeightedShuffle(cands, func(c candidate) int64 { return int64(c.d.GetWeight()) })
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
