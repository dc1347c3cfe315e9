package gateway

import (
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/upstream"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Ejected lists the deployments out of this instance's rotation right now
// (passive ejection, Retry-After parking, failed active health checks):
// what the heartbeat carries to the fleet view. Each call also refreshes
// sluice_proxy_deployments_out{model_group,reason} and counts the
// deployments back in rotation since the last call in
// sluice_proxy_deployment_returns_total{deployment,reason} (and logs
// them), so returns are seen within a heartbeat interval.
func (h *Handler) Ejected() []*configv1.EjectedDeployment {
	cat := h.cfg.Catalog()
	if cat == nil {
		return nil
	}
	now := time.Now()
	var out []*configv1.EjectedDeployment
	type key struct{ group, reason string }
	counts := map[key]int{}
	for _, d := range cat.AllDeployments() {
		st := h.states.Get(d.GetId())
		reason, until, isOut := st.Health.Out(now)
		if !isOut {
			h.countReturn(d, st)
			continue
		}
		st.MarkOut(reason)
		e := &configv1.EjectedDeployment{DeploymentId: d.GetId(), ModelGroup: d.GetModelGroup(), Reason: reason}
		if !until.IsZero() {
			e.Until = timestamppb.New(until)
		}
		out = append(out, e)
		counts[key{d.GetModelGroup(), reason}]++
	}
	h.m.deploymentsOut.Reset()
	for k, n := range counts {
		h.m.deploymentsOut.WithLabelValues(k.group, k.reason).Set(float64(n))
	}
	return out
}

// countReturn counts and logs, once, a deployment back in rotation after
// an ejection or parking ended (health-check returns are counted by the
// checker). Called where a request or the heartbeat finds it healthy.
func (h *Handler) countReturn(d *catalog.Deployment, st *upstream.State) {
	prev, ok := st.TakeReturn()
	if !ok || prev == upstream.OutHealthCheck {
		return
	}
	h.m.ejectionReturns.WithLabelValues(d.GetId(), prev).Inc()
	h.log.Info("deployment back in rotation after its ejection", "deployment", d.GetId(),
		"model_group", d.GetModelGroup(), "reason", prev)
}
