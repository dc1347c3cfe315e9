package gateway

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

// metrics are the proxy's Prometheus series (names in docs/metrics.md).
// Labels are low-cardinality: routes, model groups and deployments are
// configured objects, never request text; a requested name that resolves
// to no group is counted under model_group "".
type metrics struct {
	requests       *prometheus.CounterVec
	duration       *prometheus.HistogramVec
	ttft           *prometheus.HistogramVec
	upstreamErrors *prometheus.CounterVec
	// attempts counts upstream attempts by deployment, its standing at
	// the pick (upstream.Standing.Label) and outcome (attemptOutcome).
	attempts         *prometheus.CounterVec
	credentialErrors *prometheus.CounterVec
	// responseRecordErrors counts Responses whose deployment could not be
	// recorded (protocols.go).
	responseRecordErrors prometheus.Counter
	ejections            *prometheus.CounterVec
	streamHolds          *prometheus.CounterVec
	probation            *prometheus.CounterVec
	retries              *prometheus.CounterVec
	retryRefusals        *prometheus.CounterVec
	holdCutRetries       *prometheus.CounterVec
	healthReturns        *prometheus.CounterVec
	ejectionReturns      *prometheus.CounterVec
	deploymentsOut       *prometheus.GaugeVec
	poolOut              *prometheus.GaugeVec
	upstreamInFlight     *prometheus.GaugeVec

	limitRejections      *prometheus.CounterVec
	limitsUnavailable    *prometheus.CounterVec
	limitsFallback       *prometheus.CounterVec
	budgetAlerts         *prometheus.CounterVec
	pendingSettles       prometheus.Gauge
	settleFailures       prometheus.Counter
	settlesWithoutRecord prometheus.Counter
	leasesReasserted     prometheus.Counter

	preauthRefusals *prometheus.CounterVec
	bodyFailures    *prometheus.CounterVec
	bodyReads       prometheus.GaugeFunc
}

// durationBuckets span fast embeddings to long generations (seconds).
var durationBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

// ttftBuckets span an idle engine's first token to a saturated queue.
var ttftBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60}

// newMetrics registers the proxy's series on reg; bodyReads reads the
// number of bodies being read.
func newMetrics(reg prometheus.Registerer, bodyReads func() int64) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_requests_total",
			Help: "Requests to the OpenAI endpoints by route, model group and status class (2xx, 4xx, 5xx, 499).",
		}, []string{"route", "model_group", "status_class"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "sluice_proxy_request_duration_seconds", Buckets: durationBuckets,
			Help: "Time from the request's arrival to its last byte, by model group.",
		}, []string{"model_group"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "sluice_proxy_ttft_seconds", Buckets: ttftBuckets,
			Help: "Time from a stream's arrival to its first relayed chunk, by model group.",
		}, []string{"model_group"}),
		upstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_upstream_errors_total",
			Help: "Failed upstream attempts by deployment and kind (refused, connect, timeout, transport, status_5xx, status_429, stream).",
		}, []string{"deployment", "kind"}),
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_upstream_attempts_total",
			Help: "Upstream attempts by deployment, its standing when picked (healthy, probe: half-open, panic, and the last resorts kept in rotation by the maximum ejection percentage: ejected, probing, health_check, parked) and outcome (ok, retryable, failed, client_closed).",
		}, []string{"deployment", "state", "outcome"}),
		responseRecordErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sluice_proxy_response_record_errors_total",
			Help: "OpenAI Responses whose deployment could not be recorded in Redis (follow-ups naming them are refused).",
		}),
		credentialErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_deployment_credential_errors_total",
			Help: "Requests that found a deployment unusable because its upstream credential cannot be decrypted.",
		}, []string{"deployment"}),
		ejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_deployment_ejections_total",
			Help: "Deployments taken out of rotation by passive health (failures) or an upstream Retry-After (parked).",
		}, []string{"deployment", "reason"}),
		streamHolds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_stream_holds_total",
			Help: "Streams held back from their client until they end, their deployment is proven or the hold's bounds pass, by deployment, reason (probe, probation) and outcome (done, released, bounds, cut, aborted).",
		}, []string{"deployment", "reason", "outcome"}),
		probation: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_stream_probation_total",
			Help: "Deployments leaving stream probation (proven: a stream ended cleanly or outlived its hold) or put back on it (revoked: a stream cut), by deployment.",
		}, []string{"deployment", "event"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_retries_total",
			Help: "Attempts on another deployment after a retryable upstream failure, by model group.",
		}, []string{"model_group"}),
		healthReturns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_deployment_health_returns_total",
			Help: "Deployments back in rotation after their engine passed its active health check again.",
		}, []string{"deployment"}),
		ejectionReturns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_deployment_returns_total",
			Help: "Deployments back in rotation after a passive ejection or a Retry-After parking ended (seen within a heartbeat interval).",
		}, []string{"deployment", "reason"}),
		deploymentsOut: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_proxy_deployments_out",
			Help: "Deployments out of this instance's rotation by model group and reason (ejected, parked, health_check), as of the last heartbeat.",
		}, []string{"model_group", "reason"}),
		poolOut: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_proxy_pool_out_of_rotation_ratio",
			Help: "Share of a model group's pool (after the request's filters) the last request found out of rotation: never above --max-ejection-percent unless the pool has one deployment.",
		}, []string{"model_group"}),
		retryRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_retry_budget_refusals_total",
			Help: "Retries refused because the model group's retry budget was spent (the request got its original error).",
		}, []string{"model_group"}),
		holdCutRetries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_hold_cut_retries_total",
			Help: "Retries of streams cut within their hold (probe or stream probation) made on the held cuts' own allowance (the retry budget's minimum a window) instead of the retry budget.",
		}, []string{"model_group"}),
		upstreamInFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_proxy_upstream_in_flight",
			Help: "Requests this instance has in flight at each deployment (max_concurrency applies to it).",
		}, []string{"deployment"}),
		limitRejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_limit_rejections_total",
			Help: "Requests (or deployment attempts) refused by a limit, by scope kind and limit (rpm, tpm, parallel, budget).",
		}, []string{"scope_kind", "limit"}),
		limitsUnavailable: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_limits_unavailable_total",
			Help: "Limits-store calls that failed or timed out, by operation (admit, renew, settle).",
		}, []string{"op"}),
		limitsFallback: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_limits_fallback_total",
			Help: "Requests decided by the local rpm/tpm fallback while the limits store was unavailable, by outcome (admitted, rejected, refused).",
		}, []string{"outcome"}),
		budgetAlerts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_budget_alerts_total",
			Help: "Budget alerts fired by this instance, by scope kind and threshold (percent of the cap; 0 = soft budget).",
		}, []string{"scope_kind", "threshold"}),
		pendingSettles: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "sluice_proxy_limits_pending_settles",
			Help: "Settlements of finished requests not yet applied in the limits store.",
		}),
		settleFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sluice_proxy_limits_settle_failures_total",
			Help: "Settlements given up after retrying (leases then expire by TTL; counters keep the reservation).",
		}),
		settlesWithoutRecord: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sluice_proxy_limits_settles_without_record_total",
			Help: "Settlements that found no admission record in the limits store (state lost): usage charged in full.",
		}),
		leasesReasserted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sluice_proxy_limits_leases_reasserted_total",
			Help: "Renewals that re-asserted a live request the limits store had lost (after a restart).",
		}),
		preauthRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_preauth_refusals_total",
			Help: "Inference requests refused before a key was identified (readiness, missing or unknown key), by route and code; they write no usage event.",
		}, []string{"route", "code"}),
		bodyFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_body_read_failures_total",
			Help: "Request bodies that could not be read, by code (request_too_large, request_body_timeout, incomplete_body, client_closed_request).",
		}, []string{"code"}),
		bodyReads: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "sluice_proxy_body_reads",
			Help: "Request bodies being read now (bounded by --max-body-reads).",
		}, func() float64 { return float64(bodyReads()) }),
	}
	for _, c := range []prometheus.Collector{m.requests, m.duration, m.ttft, m.upstreamErrors, m.attempts, m.credentialErrors,
		m.ejections, m.streamHolds, m.probation, m.retries, m.retryRefusals, m.holdCutRetries, m.healthReturns, m.ejectionReturns, m.deploymentsOut, m.poolOut, m.upstreamInFlight, m.limitRejections, m.limitsUnavailable, m.limitsFallback,
		m.budgetAlerts, m.pendingSettles, m.settleFailures, m.settlesWithoutRecord, m.leasesReasserted,
		m.preauthRefusals, m.bodyFailures, m.bodyReads, m.responseRecordErrors} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func statusClass(status int) string { return statusClasses[statusClassIndex(status)] }

// Series lookups on the request path go through a cache of the vectors'
// children: WithLabelValues hashes the label values and takes the
// vector's lock on every call. Keys are configured objects (routes, model
// groups, deployments), so the cache is as bounded as the series.

// routeIndex numbers the inference routes for the per-group cache.
func routeIndex(route string) int {
	switch route {
	case RouteChat:
		return 0
	case RouteCompletions:
		return 1
	case RouteEmbeddings:
		return 2
	}
	return 3
}

var statusClasses = [...]string{"2xx", "3xx", "4xx", "5xx", "499"}

func statusClassIndex(status int) int {
	switch status {
	case openai.StatusClientClosed:
		return 4
	}
	switch {
	case status >= 500:
		return 3
	case status >= 400:
		return 2
	case status >= 300:
		return 1
	}
	return 0
}

// groupSeries are one model group's series.
type groupSeries struct {
	duration, ttft prometheus.Observer
	retries        prometheus.Counter
	// requests by routeIndex*len(statusClasses)+statusClassIndex, created
	// on first use (a series appears when it is first counted).
	requests sync.Map // int → prometheus.Counter
}

// seriesCache caches the children of the proxy's vectors.
type seriesCache struct {
	m        *metrics
	mu       sync.RWMutex
	groups   map[string]*groupSeries
	inFlight map[string]prometheus.Gauge
}

func (c *seriesCache) group(name string) *groupSeries {
	c.mu.RLock()
	g := c.groups[name]
	c.mu.RUnlock()
	if g != nil {
		return g
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if g = c.groups[name]; g == nil {
		g = &groupSeries{duration: c.m.duration.WithLabelValues(name), ttft: c.m.ttft.WithLabelValues(name),
			retries: c.m.retries.WithLabelValues(name)}
		if c.groups == nil {
			c.groups = map[string]*groupSeries{}
		}
		c.groups[name] = g
	}
	return g
}

func (c *seriesCache) requests(route, group string, status int) prometheus.Counter {
	g := c.group(group)
	k := routeIndex(route)*len(statusClasses) + statusClassIndex(status)
	if v, ok := g.requests.Load(k); ok {
		return v.(prometheus.Counter)
	}
	v, _ := g.requests.LoadOrStore(k, c.m.requests.WithLabelValues(route, group, statusClass(status)))
	return v.(prometheus.Counter)
}

func (c *seriesCache) upstreamInFlight(deployment string) prometheus.Gauge {
	c.mu.RLock()
	g := c.inFlight[deployment]
	c.mu.RUnlock()
	if g != nil {
		return g
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if g = c.inFlight[deployment]; g == nil {
		g = c.m.upstreamInFlight.WithLabelValues(deployment)
		if c.inFlight == nil {
			c.inFlight = map[string]prometheus.Gauge{}
		}
		c.inFlight[deployment] = g
	}
	return g
}

// vecCache caches the children of one vector by their label values, for
// the series counted on every request (WithLabelValues hashes and checks
// the values and locks the vector each time). Only for vectors whose
// children are never deleted.
type vecCache[K comparable, M any] struct {
	mu sync.RWMutex
	m  map[K]M
}

func (c *vecCache[K, M]) load(k K) (M, bool) {
	c.mu.RLock()
	v, ok := c.m[k]
	c.mu.RUnlock()
	return v, ok
}

func (c *vecCache[K, M]) store(k K, v M) M {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.m[k]; ok {
		return old
	}
	if c.m == nil {
		c.m = map[K]M{}
	}
	c.m[k] = v
	return v
}

// hotSeries are the per-request series outside seriesCache: traffic
// classification, upstream attempts, this proxy's prefill in flight and
// the pool's out-of-rotation share.
type hotSeries struct {
	classified vecCache[[2]string, prometheus.Counter]
	attempts   vecCache[[3]string, prometheus.Counter]
	prefillOwn vecCache[string, prometheus.Gauge]
	poolOut    vecCache[string, prometheus.Gauge]
}

func (h *Handler) classifiedSeries(class, reason string) prometheus.Counter {
	k := [2]string{class, reason}
	if v, ok := h.hot.classified.load(k); ok {
		return v
	}
	return h.hot.classified.store(k, h.am.Classified.WithLabelValues(class, reason))
}

func (h *Handler) attemptSeries(dep, standing, outcome string) prometheus.Counter {
	k := [3]string{dep, standing, outcome}
	if v, ok := h.hot.attempts.load(k); ok {
		return v
	}
	return h.hot.attempts.store(k, h.m.attempts.WithLabelValues(dep, standing, outcome))
}

func (h *Handler) prefillOwnSeries(dep string) prometheus.Gauge {
	if v, ok := h.hot.prefillOwn.load(dep); ok {
		return v
	}
	return h.hot.prefillOwn.store(dep, h.pm.own.WithLabelValues(dep))
}

func (h *Handler) poolOutSeries(group string) prometheus.Gauge {
	if v, ok := h.hot.poolOut.load(group); ok {
		return v
	}
	return h.hot.poolOut.store(group, h.m.poolOut.WithLabelValues(group))
}
