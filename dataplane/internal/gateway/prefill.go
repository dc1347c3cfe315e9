package gateway

// prefill.go: prefill-aware placement (SPEC §7.2; docs/traffic.md,
// "Prefill in flight"). Every attempt on a deployment estimates the
// uncached prompt tokens it makes the engine prefill and accounts them
// until its first token: fleet-wide in the deployment's max_concurrency
// lease (the same admission call, package limits), and on this proxy. A
// non-interactive attempt respects the deployment's
// max_prefill_tokens_in_flight (a full deployment is skipped like one at
// its class cap; when every candidate is, the request waits in the
// admission queue); an interactive request is placed on the candidate with
// the least prefill in flight (strategy.go, orderByPrefill).

import (
	"context"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// reasonPrefill is the routing reason of an interactive request placed on
// the candidate with the least prefill in flight, when that is not the
// strategy's own first choice.
const reasonPrefill = "prefill"

// prefillCallTimeout bounds the call that moves an attempt's contribution
// to zero at its first token (off the request path; a failed call is
// repaired by the lease's next renewal).
const prefillCallTimeout = time.Second

// Calibration bounds of the estimate (prefillEstimate): the engine's
// prompt tokens per estimated token seen on a session's last turn.
const minTokenRatio, maxTokenRatio = 0.5, 2.0

// minPrefillGain is the least difference in prefill tokens (in flight
// plus the request's own) for which an interactive request leaves its
// strategy's first choice: about 25 ms of prefill on an engine
// prefilling 10k tokens/s. Smaller differences are noise (the
// contribution of a request that just finished, still being released; a
// chat's few tokens) and not worth a session's pin or prefix cache.
const minPrefillGain = 256

// prefillAttempt is an attempt's prefill while it waits for its first
// token.
type prefillAttempt struct {
	mu     sync.Mutex
	dep    string
	tokens int64
	lease  *limits.Lease // the deployment lease accounting it (nil: this proxy only)
	group  string
	capped bool // the deployment has a prefill cap (waiters may be blocked by it)
	active bool
	// gate is the attempt's prefill isolation entry (gate.go; nil: its
	// group has no isolation), of model group gateGroup.
	gate      *limits.GateEntry
	gateGroup string
}

// prefillMetrics are the prefill series (docs/metrics.md).
type prefillMetrics struct {
	own      *prometheus.GaugeVec
	fleet    *prometheus.GaugeVec
	estimate prometheus.Histogram
}

func newPrefillMetrics(reg prometheus.Registerer) (*prefillMetrics, error) {
	m := &prefillMetrics{
		own: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_proxy_prefill_tokens_in_flight",
			Help: "Estimated uncached prompt tokens of this instance's requests at each deployment that have no first token yet.",
		}, []string{"deployment"}),
		fleet: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_proxy_deployment_prefill_tokens",
			Help: "A deployment's fleet-wide prefill tokens in flight (every proxy's admitted requests without a first token yet), as this instance last read it (admissions, routing reads).",
		}, []string{"deployment"}),
		estimate: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "sluice_proxy_prefill_estimate_ratio",
			Help:    "A request's estimated uncached prompt tokens divided by the engine's (prompt − cached tokens of its usage), for requests whose engine reported usage.",
			Buckets: []float64{0.25, 0.5, 0.67, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 4, 8},
		}),
	}
	for _, c := range []prometheus.Collector{m.own, m.fleet, m.estimate} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// prefillCounts are this proxy's own prefill tokens in flight per
// deployment (the placement input of deployments without max_concurrency,
// which take no fleet-wide lease).
type prefillCounts struct {
	m sync.Map // deployment id → *atomic.Int64
}

func (c *prefillCounts) get(id string) *atomic.Int64 {
	if v, ok := c.m.Load(id); ok {
		return v.(*atomic.Int64)
	}
	v, _ := c.m.LoadOrStore(id, new(atomic.Int64))
	return v.(*atomic.Int64)
}

// prefillCap is the prefill cap a request of class c respects on d (0:
// none): interactive requests are never capped.
func prefillCap(d *catalog.Deployment, c configv1.TrafficClass) int64 {
	if c == configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE || d.GetMaxConcurrency() <= 0 {
		return 0
	}
	return d.GetTraffic().GetMaxPrefillTokensInFlight()
}

// prefillEstimate is the uncached prompt tokens the request makes d
// prefill (docs/traffic.md, "The estimate"): the prompt estimate (about 4
// bytes a token), calibrated, for a session with a recorded last turn, by
// that turn's ratio of engine tokens to estimated ones; on the deployment
// that served that turn, whose prefix cache holds its prompt and
// completion, less those. A prompt shorter than the last turn's (the
// conversation was edited or compacted) is assumed uncached.
func (x *exchange) prefillEstimate(d *catalog.Deployment) int64 {
	if x.req == nil {
		return 0
	}
	est := x.req.PromptEstimate()
	t := x.aff.turn
	if t.Deployment == "" || t.Estimate <= 0 || t.Prompt <= 0 {
		return est
	}
	ratio := min(max(float64(t.Prompt)/float64(t.Estimate), minTokenRatio), maxTokenRatio)
	scaled := int64(math.Round(float64(est) * ratio))
	if t.Deployment != d.GetId() || scaled < t.Prompt {
		return scaled
	}
	return max(scaled-t.Prompt-t.Completion, 0)
}

// startPrefill accounts an attempt's prefill on d on this proxy (the
// fleet-wide part is in lease, when d takes one).
func (x *exchange) startPrefill(d *catalog.Deployment, tokens int64, lease *limits.Lease, gate *limits.GateEntry) {
	p := &x.pf
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dep, p.tokens, p.lease, p.group, p.active = d.GetId(), tokens, lease, x.group, true
	p.gate, p.gateGroup = gate, d.GetModelGroup()
	p.capped = d.GetTraffic().GetMaxPrefillTokensInFlight() > 0
	x.h.prefill.get(p.dep).Add(tokens)
	x.h.prefillOwnSeries(p.dep).Add(float64(tokens))
}

// endPrefill ends the attempt's prefill: at its first token (firstToken:
// the fleet-wide contribution moves to zero now, and the group's waiters
// try again when the deployment has a prefill cap), or when the attempt
// ends (its lease's release removes the contribution). A prefill
// isolation entry leaves the gate either way (gate.go).
func (x *exchange) endPrefill(firstToken bool) {
	p := &x.pf
	p.mu.Lock()
	if !p.active {
		p.mu.Unlock()
		return
	}
	p.active = false
	dep, tokens, lease, group, capped := p.dep, p.tokens, p.lease, p.group, p.capped
	gate, gateGroup := p.gate, p.gateGroup
	p.gate = nil
	p.mu.Unlock()
	x.h.leaveGate(gate, gateGroup) // first token or end of the attempt: the deployment's prefill is over
	x.h.prefill.get(dep).Add(-tokens)
	x.h.prefillOwnSeries(dep).Sub(float64(tokens))
	lim := x.h.cfg.Limiter
	if !firstToken || lease == nil || lim == nil || !lease.HasPrefill() || lease.Prefill() == 0 {
		return
	}
	h := x.h
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), prefillCallTimeout)
		defer cancel()
		if err := lim.PrefillDone(ctx, lease); err != nil {
			h.m.limitsUnavailable.WithLabelValues("prefill").Inc()
			return
		}
		if capped {
			h.queues.Released(group) // prefill room freed: waiters held by the cap try again
		}
	}()
}

// correctPrefill replaces the attempt's estimate with the engine's
// uncached prompt tokens once its usage reports them, if it is still in
// prefill (a usage report before the first token), and records the
// estimate's error.
func (x *exchange) correctPrefill(prompt, cached int64) {
	p := &x.pf
	p.mu.Lock()
	est := p.tokens
	dep := p.dep
	active, lease := p.active, p.lease
	actual := max(prompt-cached, 0)
	if dep == "" {
		p.mu.Unlock()
		return
	}
	if active && actual != est {
		x.h.prefill.get(dep).Add(actual - est)
		x.h.prefillOwnSeries(dep).Add(float64(actual - est))
		p.tokens = actual
	}
	p.mu.Unlock()
	if actual > 0 {
		x.h.pm.estimate.Observe(float64(est) / float64(actual))
	}
	lim := x.h.cfg.Limiter
	// A complete (non-streamed) answer carries its usage as the attempt
	// ends: its lease's release removes the contribution right after.
	if !active || lease == nil || lim == nil || !lease.HasPrefill() || !x.req.Stream() {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), prefillCallTimeout)
		defer cancel()
		_ = lim.SetPrefill(ctx, lease, actual) // repaired by the next renewal when it fails
	}()
}

// sawPrefill records a deployment's fleet-wide prefill in flight as read.
func (h *Handler) sawPrefill(dep string, n int64) {
	if n >= 0 {
		h.pm.fleet.WithLabelValues(dep).Set(float64(n))
	}
}

// prefillOrdered reports whether the exchange's candidates are placed by
// prefill in flight: interactive requests whose group sets no strategy or
// a load-aware one (least_outstanding, engine_load). An explicit affinity
// or weighted_shuffle keeps its own order (docs/routing.md, "Strategies").
func (x *exchange) prefillOrdered() bool {
	return x.classEnum == configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE && (!x.rt.explicit || x.rt.loadAware())
}

// orderByPrefill orders cands (the strategy's order) for an interactive
// request: least prefill in flight first (the candidate's fleet-wide
// count, else this proxy's, plus the request's own estimate there), ties
// by the most free slots (max_concurrency − fleet-wide in flight), then
// the strategy's order. The strategy's order stands when no candidate
// has minPrefillGain tokens less than its first choice.
func (x *exchange) orderByPrefill(cands []candidate, look affinity.Lookup) []candidate {
	if len(cands) < 2 {
		return cands
	}
	type scored struct {
		c             candidate
		prefill, free int64
	}
	// The lookup's answers, by deployment (its keys were asked in the
	// candidates' order before the strategy reordered them).
	at := make(map[string]int, len(x.aff.prefillIDs))
	for i, id := range x.aff.prefillIDs {
		at[id] = i
	}
	out := make([]scored, len(cands))
	for i, c := range cands {
		d := c.d
		s := scored{c: c, prefill: x.h.prefill.get(d.GetId()).Load()}
		if mc := d.GetMaxConcurrency(); mc > 0 {
			s.free = mc - c.st.Slots.InFlight()
			if li, ok := at[d.GetId()]; ok {
				if li < len(look.Prefill) && look.Prefill[li] >= 0 {
					s.prefill = look.Prefill[li]
					x.h.sawPrefill(d.GetId(), s.prefill)
				}
				if li < len(look.Loads) && look.Loads[li] >= 0 {
					s.free = mc - look.Loads[li]
				}
			}
		}
		s.prefill = max(s.prefill, 0) + x.prefillEstimate(d)
		out[i] = s
	}
	least := out[0].prefill
	for _, s := range out {
		least = min(least, s.prefill)
	}
	if out[0].prefill-least < minPrefillGain {
		return cands
	}
	slices.SortStableFunc(out, func(p, q scored) int {
		switch {
		case p.prefill < q.prefill:
			return -1
		case p.prefill > q.prefill:
			return 1
		case p.free > q.free:
			return -1
		case p.free < q.free:
			return 1
		}
		return 0
	})
	res := make([]candidate, len(out))
	for i := range out {
		res[i] = out[i].c
	}
	return res
}

// prefillKeys are the prefill hashes of cands with max_concurrency and
// their deployments, in the order of their lease keys (the lookup's
// Loads).
func prefillKeys(lim *limits.Limiter, cands []candidate) (keys, ids []string) {
	for _, c := range cands {
		if c.d.GetMaxConcurrency() > 0 {
			keys = append(keys, lim.DeploymentPrefillKey(c.d.GetId()))
			ids = append(ids, c.d.GetId())
		}
	}
	return keys, ids
}
