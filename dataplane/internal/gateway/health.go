package gateway

import (
	"context"

	"github.com/sluicegw/sluice/dataplane/internal/upstream"
)

// RunHealthChecks probes every deployment's /health until ctx ends (a
// component; upstream.Checker): a deployment whose engine fails
// HealthCheckUnhealthy probes in a row is out of rotation (within the
// maximum ejection percentage) until HealthCheckHealthy succeed. With
// NoHealthChecks it only waits for ctx.
func (h *Handler) RunHealthChecks(ctx context.Context) error {
	if h.cfg.NoHealthChecks {
		<-ctx.Done()
		return nil
	}
	c := &upstream.Checker{
		Targets: func() []upstream.Target {
			cat := h.cfg.Catalog()
			if cat == nil {
				return nil
			}
			deps := cat.AllDeployments()
			out := make([]upstream.Target, 0, len(deps))
			for _, d := range deps {
				out = append(out, upstream.Target{ID: d.GetId(), APIBase: d.GetApiBase()})
			}
			return out
		},
		States: &h.states, Client: h.fwd.Client,
		Interval: h.cfg.HealthCheckInterval, Timeout: h.cfg.HealthCheckTimeout,
		UnhealthyThreshold: h.cfg.HealthCheckUnhealthy, HealthyThreshold: h.cfg.HealthCheckHealthy,
		OnChange: func(id string, down bool) {
			if down {
				h.m.ejections.WithLabelValues(id, "health_check").Inc()
				h.log.Warn("deployment out of rotation: its engine fails its health check", "deployment", id)
				return
			}
			h.m.healthReturns.WithLabelValues(id).Inc()
			h.log.Info("deployment back in rotation: its engine passes its health check", "deployment", id)
		},
	}
	return c.Run(ctx)
}
