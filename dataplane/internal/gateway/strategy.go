package gateway

import (
	"context"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/routing"
	"github.com/sluicegw/sluice/dataplane/internal/upstream"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Routing strategies of a model group (docs/routing.md, "Strategies"),
// as the admin API names them in ModelGroup.routing.strategy.
const (
	strategyWeightedShuffle  = "weighted_shuffle"
	strategyAffinity         = "affinity"
	strategyLeastOutstanding = "least_outstanding"
	strategyEngineLoad       = "engine_load"
)

// groupRouting is what an exchange routes by: the effective strategy and
// the group's settings, defaults applied.
type groupRouting struct {
	strategy   string
	sessionTTL time.Duration
	loadFactor float64
	// explicit: the group sets the strategy (not the class defaults).
	explicit bool
}

// routingOf resolves the exchange's strategy from its group's settings,
// its traffic class and whether it carries a session. An explicit group
// strategy applies to every class; without one, agent and batch requests
// and requests with a session use affinity, interactive requests without
// a session the weighted shuffle (a chat's turn carries no cached prefix
// worth concentrating load for, and spreading it keeps its TTFT low). A
// strategy this build does not know (a newer control plane) counts as
// none.
func routingOf(g *configv1.ModelGroup, class configv1.TrafficClass, hasSession bool) groupRouting {
	r := g.GetRouting()
	out := groupRouting{strategy: r.GetStrategy(), sessionTTL: affinity.DefaultSessionTTL, loadFactor: routing.DefaultLoadFactor}
	if ms := r.GetSessionTtlMs(); ms > 0 {
		out.sessionTTL = time.Duration(ms) * time.Millisecond
	}
	if c := r.GetLoadFactor(); c >= 1 {
		out.loadFactor = c
	}
	switch out.strategy {
	case strategyWeightedShuffle, strategyAffinity, strategyLeastOutstanding, strategyEngineLoad:
		out.explicit = true
		return out
	}
	switch {
	case class == configv1.TrafficClass_TRAFFIC_CLASS_AGENT, class == configv1.TrafficClass_TRAFFIC_CLASS_BATCH, hasSession:
		out.strategy = strategyAffinity
	default:
		out.strategy = strategyWeightedShuffle
	}
	return out
}

// loadAware reports whether the strategy orders by load alone.
func (r groupRouting) loadAware() bool {
	return r.strategy == strategyLeastOutstanding || r.strategy == strategyEngineLoad
}

// startLoadLookup starts the read of the candidates' fleet-wide in-flight
// counts (their max_concurrency leases) for a load-aware strategy,
// concurrently with the admission call like the affinity lookup.
func (x *exchange) startLoadLookup(ctx context.Context, cands []candidate) {
	a := &x.aff
	store, lim := x.h.cfg.Affinity, x.h.cfg.Limiter
	if store == nil || lim == nil || len(cands) < 2 {
		return
	}
	keys := make([]string, len(cands))
	for i, c := range cands {
		if c.d.GetMaxConcurrency() > 0 {
			keys[i] = lim.DeploymentLeaseKey(c.d.GetId())
		}
	}
	keys = compactKeys(keys)
	if len(keys) == 0 {
		return
	}
	k := affinity.Keys{Loads: keys}
	if x.prefillOrdered() {
		k.Prefill, a.prefillIDs = prefillKeys(lim, cands)
		k.PrefillField = limits.PrefillField
	}
	a.lookup = make(chan affinityLookup, 1)
	go func() {
		res, err := store.LookupKeys(ctx, k, time.Now())
		a.lookup <- affinityLookup{res, err}
	}()
}

// loadedOf returns each candidate's load: its fleet-wide lease count when
// the lookup answered for every candidate asked, else this proxy's
// in-flight count. A lookup answered in part (it timed out midway) counts
// as not answered: a candidate whose fleet-wide count is missing would
// look idle next to the others' and draw every request.
func (x *exchange) loadedOf(cands []candidate, look affinityLookup) []routing.Loaded {
	loaded := make([]routing.Loaded, len(cands))
	fleet := look.res.Loads
	if !look.res.LoadsComplete() {
		fleet = nil
	}
	li := 0
	for i, c := range cands {
		loaded[i] = routing.Loaded{ID: c.d.GetId(), Weight: int64(c.d.GetWeight()), Load: c.st.Slots.InFlight()}
		if c.d.GetMaxConcurrency() > 0 && x.h.cfg.Limiter != nil && li < len(fleet) {
			loaded[i].Load = fleet[li]
			li++
		}
	}
	return loaded
}

// orderByLoad orders cands (already shuffled by weight, which breaks
// ties) by load per unit of weight, least first. least_outstanding counts
// the fleet-wide in-flight requests; engine_load counts, for an engine
// whose /metrics sample is fresh, the larger of its requests running plus
// waiting and the fleet-wide in-flight count (an engine's page lags the
// requests dispatched since it was read, and the leases never do), with
// the KV-cache usage breaking ties; an engine without a fresh sample
// counts its fleet-wide in-flight requests alone.
func (x *exchange) orderByLoad(cands []candidate) []candidate {
	a := &x.aff
	a.reason = reasonLoad
	if len(cands) == 0 {
		return cands
	}
	look, fresh := x.awaitLookup()
	if fresh && look.err != nil {
		x.h.em.loadLookups.WithLabelValues("error").Inc()
	}
	loaded := x.loadedOf(cands, look)
	type scored struct {
		c         candidate
		load, tie float64
	}
	now := time.Now()
	out := make([]scored, len(cands))
	for i, c := range cands {
		load := float64(max(loaded[i].Load, 0))
		tie := 0.0
		if x.rt.strategy == strategyEngineLoad {
			if s, ok := c.st.Engine.Fresh(now, x.h.cfg.EngineMetricsMaxAge); ok {
				load = max(load, s.Running+s.Waiting)
				tie = s.KVUsage
				x.h.em.engineLoad.WithLabelValues("metrics").Inc()
			} else {
				x.h.em.engineLoad.WithLabelValues("stale").Inc()
			}
		}
		out[i] = scored{c, load / float64(max(c.d.GetWeight(), 1)), tie}
	}
	slices.SortStableFunc(out, func(p, q scored) int {
		switch {
		case p.load < q.load:
			return -1
		case p.load > q.load:
			return 1
		case p.tie < q.tie:
			return -1
		case p.tie > q.tie:
			return 1
		}
		return 0
	})
	for i := range out {
		cands[i] = out[i].c
	}
	a.first = cands[0].d.GetId()
	return cands
}

// engineMetrics count the load-aware strategies' inputs.
type engineMetrics struct {
	polls       *prometheus.CounterVec
	engineLoad  *prometheus.CounterVec
	loadLookups *prometheus.CounterVec
}

func newEngineMetrics(reg prometheus.Registerer) (*engineMetrics, error) {
	m := &engineMetrics{
		polls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_engine_metrics_polls_total",
			Help: "Polls of the engines' /metrics for the engine_load strategy, by deployment and outcome (ok, error: unreachable, timed out, not 200 or no vLLM load series).",
		}, []string{"deployment", "outcome"}),
		engineLoad: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_engine_load_inputs_total",
			Help: "Candidates weighed by the engine_load strategy, by input: metrics (a fresh /metrics sample), stale (no sample within --engine-metrics-max-age: the fleet-wide in-flight count alone).",
		}, []string{"input"}),
		loadLookups: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_load_lookups_total",
			Help: "Failed or timed-out reads of the fleet-wide in-flight counts for least_outstanding and engine_load (outcome=error: ordered by this proxy's own counts, for every candidate).",
		}, []string{"outcome"}),
	}
	for _, c := range []prometheus.Collector{m.polls, m.engineLoad, m.loadLookups} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// RunEngineMetrics polls the /metrics of the engines of every model group
// whose strategy is engine_load until ctx ends (a component;
// upstream.MetricsPoller). With NoEngineMetrics it only waits for ctx.
func (h *Handler) RunEngineMetrics(ctx context.Context) error {
	if h.cfg.NoEngineMetrics {
		<-ctx.Done()
		return nil
	}
	p := &upstream.MetricsPoller{
		Targets: func() []upstream.MetricsTarget { return engineLoadTargets(h.cfg.Catalog()) },
		States:  &h.states, Client: h.fwd.Client, Interval: h.cfg.EngineMetricsInterval,
		OnResult: func(id string, ok bool) {
			if ok {
				h.em.polls.WithLabelValues(id, "ok").Inc()
			} else {
				h.em.polls.WithLabelValues(id, "error").Inc()
			}
		},
	}
	return p.Run(ctx)
}

// engineLoadTargets are the deployments of cat's engine_load groups.
func engineLoadTargets(cat *catalog.Catalog) []upstream.MetricsTarget {
	if cat == nil {
		return nil
	}
	var out []upstream.MetricsTarget
	for _, d := range cat.AllDeployments() {
		if cat.ModelGroup(d.GetModelGroup()).GetRouting().GetStrategy() != strategyEngineLoad || d.CredentialErr != nil {
			continue
		}
		out = append(out, upstream.MetricsTarget{ID: d.GetId(), APIBase: d.GetApiBase(), Credential: d.Credential})
	}
	return out
}
