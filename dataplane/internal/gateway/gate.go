package gateway

// gate.go: prefill isolation (docs/traffic.md, "Prefill isolation"). A
// model group with prefill_isolation K keeps K of its N deployments free
// of agent and batch prefill at every moment, fleet-wide: an agent or
// batch attempt registers its prefill at the group's gate (one script
// call, package limits, lua/gate.lua) before it takes the deployment's
// lease, and is refused on a deployment when that would make more than
// N − K deployments carry agent prefill or the deployment has interactive
// prefill in flight; an interactive request registers its prefill on a
// candidate without agent prefill. Entries leave at the first token (or
// when the attempt ends) and wake the group's waiters fleet-wide. Groups
// without the setting never call the gate.

import (
	"context"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// reasonIsolation is the routing reason of an interactive request placed
// on a deployment without agent prefill in flight when that is not its
// strategy's first choice.
const reasonIsolation = "isolation"

// Gate outcomes (sluice_proxy_prefill_gate_total{outcome}).
const (
	gateEntered    = "entered"
	gatePlacedFree = "placed_free"
	gatePlacedBusy = "placed_busy"
)

func newGateMetric(reg prometheus.Registerer) (*prometheus.CounterVec, error) {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_proxy_prefill_gate_total",
		Help: "Prefill isolation gate decisions of this instance, by model group, class and outcome (entered; refused_interactive, refused_isolation, refused_run: an agent or batch attempt kept off a deployment; placed_free, placed_busy: an interactive request placed on a deployment without, or with, agent prefill in flight).",
	}, []string{"model_group", "class", "outcome"})
	return c, reg.Register(c)
}

// isolation is the prefill isolation of d's model group: most is the
// most deployments of the group that may carry agent prefill at once
// (N − K, at least 1: the group's deployments in the snapshot, whatever
// their health or this request's filters). ok is false for groups
// without the setting or without a limits store.
func (x *exchange) isolation(d *catalog.Deployment) (group string, most int, ok bool) {
	if x.h.cfg.Limiter == nil || x.cat == nil {
		return "", 0, false
	}
	group = d.GetModelGroup()
	k := x.cat.ModelGroup(group).GetTraffic().GetPrefillIsolation()
	if k <= 0 {
		return "", 0, false
	}
	return group, max(len(x.cat.Deployments(group))-int(k), 1), true
}

// gateID is the attempt's member id at a gate (the attempt about to be
// made).
func (x *exchange) gateID() string { return x.id + "/" + strconv.Itoa(x.attempts) }

// placeInteractive places an interactive request of an isolated group:
// the candidates of cands[next]'s group from next on (the strategy's
// order) are offered to the gate, which registers the request's prefill
// on the first without agent prefill in flight; that candidate is moved
// to next. nil when the group has no isolation or fewer than two
// candidates are left.
func (x *exchange) placeInteractive(ctx context.Context, cands []candidate, next int) (*limits.GateEntry, *openai.Error) {
	if x.classEnum != configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE || next >= len(cands) {
		return nil, nil
	}
	group, _, ok := x.isolation(cands[next].d)
	if !ok {
		return nil, nil
	}
	var ids []string
	for i := next; i < len(cands) && cands[i].d.GetModelGroup() == group; i++ {
		ids = append(ids, cands[i].d.GetId())
	}
	if len(ids) < 2 {
		return nil, nil
	}
	e, idx, free, err := x.h.cfg.Limiter.GatePlace(ctx, group, x.gateID(), ids)
	if err != nil {
		x.h.m.limitsUnavailable.WithLabelValues("gate").Inc()
		return nil, limitsUnavailable("the limits store did not answer in time; prefill isolation cannot be checked")
	}
	outcome := gatePlacedBusy
	if free {
		outcome = gatePlacedFree
	}
	x.h.gateM.WithLabelValues(group, x.class, outcome).Inc()
	if idx > 0 {
		c := cands[next+idx]
		copy(cands[next+1:next+idx+1], cands[next:next+idx])
		cands[next] = c
		if x.attempts == 0 && group == x.group {
			x.aff.first, x.aff.reason = c.d.GetId(), reasonIsolation
		}
	}
	return e, nil
}

// enterGate registers a non-interactive attempt's prefill on d at its
// group's gate. ok is false when the gate refuses (the caller skips d);
// e is nil when d's group has no isolation.
func (x *exchange) enterGate(ctx context.Context, d *catalog.Deployment) (e *limits.GateEntry, ok bool, fail *openai.Error) {
	if x.classEnum == configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE {
		return nil, true, nil
	}
	group, most, iso := x.isolation(d)
	if !iso {
		return nil, true, nil
	}
	e, refused, err := x.h.cfg.Limiter.GateEnter(ctx, group, d.GetId(), x.gateID(), most)
	if err != nil {
		x.h.m.limitsUnavailable.WithLabelValues("gate").Inc()
		return nil, false, limitsUnavailable("the limits store did not answer in time; prefill isolation cannot be checked")
	}
	if refused != "" {
		x.gateWaited = true
		x.h.gateM.WithLabelValues(group, x.class, "refused_"+refused).Inc()
		return nil, false, nil
	}
	x.h.gateM.WithLabelValues(group, x.class, gateEntered).Inc()
	return e, true, nil
}

// dropGate removes a gate entry the request made but does not use (the
// deployment's lease was refused, or an interactive request placed there
// was served elsewhere) before the request goes on, without waking
// anyone: no prefill ran under it. A waiter woken by it would be the
// request itself, back from its own failed try: it would try again at
// once, and a queued request whose group stays full would loop on gate
// and lease calls until a slot freed (TestPrefillIsolation). An
// agent the entry kept off a deployment meanwhile tries again at its
// queue's retry interval. A failed call is repaired by the entry's expiry.
func (h *Handler) dropGate(e *limits.GateEntry) {
	if e == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), prefillCallTimeout)
	defer cancel()
	if err := h.cfg.Limiter.GateLeave(ctx, e); err != nil {
		h.m.limitsUnavailable.WithLabelValues("gate").Inc()
	}
}

// leaveGate removes a gate entry off the request path and wakes the
// group's waiters on every proxy (agent and batch requests the entry kept
// off a deployment). A failed call is repaired by the entry's expiry.
func (h *Handler) leaveGate(e *limits.GateEntry, group string) {
	if e == nil {
		return
	}
	lim := h.cfg.Limiter
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), prefillCallTimeout)
		defer cancel()
		if err := lim.GateLeave(ctx, e); err != nil {
			h.m.limitsUnavailable.WithLabelValues("gate").Inc()
			return
		}
		h.queues.Released(group)
	}()
}

// renewGate renews the attempt's gate entry (with its leases); false when
// the call failed.
func (x *exchange) renewGate(ctx context.Context) bool {
	p := &x.pf
	p.mu.Lock()
	e := p.gate
	if !p.active {
		e = nil
	}
	p.mu.Unlock()
	if e == nil {
		return true
	}
	if _, err := x.h.cfg.Limiter.GateRenew(ctx, e); err != nil {
		x.h.m.limitsUnavailable.WithLabelValues("renew").Inc()
		return false
	}
	return true
}
