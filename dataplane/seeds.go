package dataplane

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// DefaultBudgetSeedWait bounds how long a request waits for the seeds of
// budget windows Redis does not hold (limits.DefaultSeedWait).
const DefaultBudgetSeedWait = limits.DefaultSeedWait

// seedClient asks the control plane for the ledger's current spend of
// budget windows Redis does not hold (wire.BudgetSeedSubject, core NATS
// request/reply answered by one control-plane replica of the queue group).
// It is the limiter's limits.SeedFunc: every failure is an error, so the
// limiter keeps the scope closed (503 limits_recovering).
type seedClient struct {
	nc *nats.Conn
	// Outcomes of seed requests (sluice_proxy_budget_seed_requests_total).
	ok, failed, timeouts, noResponders atomic.Int64
}

// seeds implements limits.SeedFunc.
func (c *seedClient) seeds(ctx context.Context, orgID string, needs []limits.SeedNeed) ([]int64, error) {
	req := &configv1.BudgetSeedRequest{OrgId: orgID, Scopes: make([]*configv1.BudgetSeed, len(needs))}
	if dl, ok := ctx.Deadline(); ok {
		req.WaitMs = max(time.Until(dl).Milliseconds(), 1)
	}
	for i, n := range needs {
		req.Scopes[i] = &configv1.BudgetSeed{OrgId: orgID, Kind: n.Scope.Kind, Id: n.Scope.ID, Window: n.Window, WindowStart: n.WindowStart}
	}
	data, err := wire.Marshal(req)
	if err != nil {
		c.failed.Add(1)
		return nil, fmt.Errorf("encode seed request: %w", err)
	}
	msg, err := c.nc.RequestWithContext(ctx, wire.BudgetSeedSubject, data)
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		c.noResponders.Add(1)
		return nil, fmt.Errorf("no control plane answers seed requests: %w", err)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout):
		c.timeouts.Add(1)
		return nil, fmt.Errorf("the control plane did not answer the seed request in time: %w", err)
	case err != nil:
		c.failed.Add(1)
		return nil, fmt.Errorf("seed request: %w", err)
	}
	spend, err := seedReply(msg.Data, req)
	if err != nil {
		c.failed.Add(1)
		return nil, err
	}
	c.ok.Add(1)
	return spend, nil
}

// seedReply checks a BudgetSeedReply against its request and returns the
// spend of each scope, in order.
func seedReply(data []byte, req *configv1.BudgetSeedRequest) ([]int64, error) {
	var rep configv1.BudgetSeedReply
	if err := wire.Unmarshal(data, &rep); err != nil {
		return nil, fmt.Errorf("decode seed reply: %w", err)
	}
	if rep.GetError() != "" {
		return nil, fmt.Errorf("control plane: %s", rep.GetError())
	}
	if len(rep.GetSeeds()) != len(req.GetScopes()) {
		return nil, fmt.Errorf("seed reply has %d seeds for %d scopes", len(rep.GetSeeds()), len(req.GetScopes()))
	}
	out := make([]int64, len(rep.GetSeeds()))
	for i, s := range rep.GetSeeds() {
		q := req.GetScopes()[i]
		if s.GetOrgId() != q.GetOrgId() || s.GetKind() != q.GetKind() || s.GetId() != q.GetId() ||
			s.GetWindow() != q.GetWindow() || s.GetWindowStart() != q.GetWindowStart() || s.GetSpendMicros() < 0 {
			return nil, fmt.Errorf("seed reply %d (%s %s %s@%d) does not answer %s %s %s@%d", i,
				s.GetKind(), s.GetId(), s.GetWindow(), s.GetWindowStart(), q.GetKind(), q.GetId(), q.GetWindow(), q.GetWindowStart())
		}
		out[i] = s.GetSpendMicros()
	}
	return out, nil
}

// registerSeedMetrics exposes the seed requests' outcomes.
func (d *DataPlane) registerSeedMetrics() {
	const help = "Budget seed requests to the control plane by outcome (ok, error, timeout, no_responders)."
	for outcome, n := range map[string]*atomic.Int64{"ok": &d.seeds.ok, "error": &d.seeds.failed,
		"timeout": &d.seeds.timeouts, "no_responders": &d.seeds.noResponders} {
		d.registry.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "sluice_proxy_budget_seed_requests_total",
			Help: help, ConstLabels: prometheus.Labels{"outcome": outcome}}, func() float64 { return float64(n.Load()) }))
	}
}
