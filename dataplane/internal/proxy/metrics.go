package proxy

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the proxy's Prometheus series (names in docs/metrics.md).
// Labels are low-cardinality: routes, model groups and deployments are
// configured objects, never request text; a requested name that resolves
// to no group is counted under model_group "".
type metrics struct {
	requests         *prometheus.CounterVec
	duration         *prometheus.HistogramVec
	ttft             *prometheus.HistogramVec
	upstreamErrors   *prometheus.CounterVec
	credentialErrors *prometheus.CounterVec
	ejections        *prometheus.CounterVec
	retries          *prometheus.CounterVec
	upstreamInFlight *prometheus.GaugeVec
}

// durationBuckets span fast embeddings to long generations (seconds).
var durationBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

// ttftBuckets span an idle engine's first token to a saturated queue.
var ttftBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
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
		credentialErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_deployment_credential_errors_total",
			Help: "Requests that found a deployment unusable because its upstream credential cannot be decrypted.",
		}, []string{"deployment"}),
		ejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_deployment_ejections_total",
			Help: "Deployments taken out of rotation by passive health (failures) or an upstream Retry-After (parked).",
		}, []string{"deployment", "reason"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_retries_total",
			Help: "Attempts on another deployment after a retryable upstream failure, by model group.",
		}, []string{"model_group"}),
		upstreamInFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_proxy_upstream_in_flight",
			Help: "Requests this instance has in flight at each deployment (max_concurrency applies to it).",
		}, []string{"deployment"}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.duration, m.ttft, m.upstreamErrors, m.credentialErrors,
		m.ejections, m.retries, m.upstreamInFlight} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func statusClass(status int) string {
	switch {
	case status == StatusClientClosed:
		return "499"
	case status >= 500:
		return "5xx"
	case status >= 400:
		return "4xx"
	case status >= 300:
		return "3xx"
	}
	return "2xx"
}
