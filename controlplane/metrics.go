package controlplane

import (
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/sluicegw/sluice/controlplane/internal/alerts"
	"github.com/sluicegw/sluice/controlplane/internal/publish"
	"github.com/sluicegw/sluice/controlplane/internal/seeds"
	"github.com/sluicegw/sluice/controlplane/internal/spend"
)

// metrics are the control plane's Prometheus metrics (names in
// docs/metrics.md). Labels stay low-cardinality: the admin procedure set
// is fixed by the proto.
type metrics struct {
	reg      *prometheus.Registry
	rpcs     *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

func newMetrics(pool *pgxpool.Pool, pub *publish.Publisher, sc *spend.Consumer, ac *alerts.Consumer, ad *alerts.Deliverer, sr *seeds.Responder) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		rpcs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_control_admin_requests_total", Help: "Admin RPCs by service, method and Connect code.",
		}, []string{"service", "method", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "sluice_control_admin_request_duration_seconds", Help: "Admin RPC latency by service.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
		}, []string{"service"}),
	}
	m.reg.MustRegister(m.rpcs, m.duration, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	gauge := func(name, help string, f func() float64) {
		m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, f))
	}
	counter := func(name, help string, f func() float64) {
		m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, f))
	}
	gauge("sluice_control_publisher_leader", "1 while this replica publishes config.", func() float64 {
		if pub.Stats().Leader {
			return 1
		}
		return 0
	})
	counter("sluice_control_events_published_total", "Region events appended (one per region per change).", func() float64 { return float64(pub.Stats().EventsPublished) })
	counter("sluice_control_snapshots_compiled_total", "Snapshots compiled by this replica.", func() float64 { return float64(pub.Stats().Compiles) })
	counter("sluice_control_snapshot_compile_errors_total", "Failed snapshot compilations.", func() float64 { return float64(pub.Stats().CompileErrors) })
	gauge("sluice_control_snapshot_version", "Last snapshot version compiled by this replica.", func() float64 { return float64(pub.Stats().LastVersion) })
	gauge("sluice_control_snapshot_compile_seconds", "Duration of the last snapshot compilation.", func() float64 { return pub.Stats().LastCompile.Seconds() })
	gauge("sluice_control_snapshot_size_bytes", "Size of the last compiled snapshot.", func() float64 { return float64(pub.Stats().LastSnapshotBytes) })
	counter("sluice_control_distribution_epochs_total", "Distribution epochs started by this replica (JetStream found ahead of the database).", func() float64 { return float64(pub.Stats().EpochsStarted) })
	counter("sluice_control_heartbeats_total", "Data-plane heartbeats recorded.", func() float64 { return float64(pub.Stats().Heartbeats) })
	counter("sluice_control_spend_recorded_total", "Usage events newly written to the ledger.", func() float64 { return float64(sc.Stats().Recorded) })
	counter("sluice_control_spend_duplicates_total", "Usage events already in the ledger (redeliveries).", func() float64 { return float64(sc.Stats().Duplicates) })
	counter("sluice_control_spend_undecodable_total", "Usage events terminated as undecodable.", func() float64 { return float64(sc.Stats().Undecodable) })
	counter("sluice_control_spend_not_yet_total", "Usage messages left in the stream because this build cannot read their encoding (upgrade it).", func() float64 { return float64(sc.Stats().NotYet) })
	counter("sluice_control_spend_batch_failures_total", "Ledger transactions that failed (batch redelivered).", func() float64 { return float64(sc.Stats().Failures) })
	counter("sluice_control_spend_fetch_errors_total", "Failed fetches from the usage stream.", func() float64 { return float64(sc.Stats().FetchErrors) })
	counter("sluice_control_budget_alerts_recorded_total", "Budget alerts newly written to budget_alerts.", func() float64 { return float64(ac.Stats().Recorded) })
	counter("sluice_control_budget_alerts_duplicates_total", "Budget alerts already recorded (redeliveries, republished copies).", func() float64 { return float64(ac.Stats().Duplicates) })
	counter("sluice_control_budget_alerts_undecodable_total", "Budget alerts terminated as malformed.", func() float64 { return float64(ac.Stats().Undecodable) })
	counter("sluice_control_budget_alerts_batch_failures_total", "Alert transactions that failed (batch redelivered).", func() float64 { return float64(ac.Stats().Failures) })
	counter("sluice_control_budget_alerts_fetch_errors_total", "Failed fetches from the alert stream.", func() float64 { return float64(ac.Stats().FetchErrors) })
	counter("sluice_control_alert_webhook_delivered_total", "Alert deliveries to webhooks that succeeded (by this replica).", func() float64 { return float64(ad.Stats().Delivered) })
	counter("sluice_control_alert_webhook_failed_total", "Alert delivery attempts that failed (retried with backoff, or dead).", func() float64 { return float64(ad.Stats().Failed) })
	counter("sluice_control_alert_webhook_dead_total", "Alert deliveries that became dead after their last attempt.", func() float64 { return float64(ad.Stats().Dead) })
	counter("sluice_control_budget_seeds_answered_total", "Budget seed requests answered with the ledger's spend.", func() float64 { return float64(sr.Stats().Answered) })
	counter("sluice_control_budget_seeds_failed_total", "Budget seed requests answered with an error (invalid, Postgres down, ledger behind).", func() float64 { return float64(sr.Stats().Failed) })
	gauge("sluice_control_db_connections_acquired", "Postgres connections in use.", func() float64 { return float64(pool.Stat().AcquiredConns()) })
	gauge("sluice_control_db_connections_total", "Postgres connections open.", func() float64 { return float64(pool.Stat().TotalConns()) })
	return m
}

// observe records one admin RPC ("/sluice.admin.v1.KeyService/CreateKey").
func (m *metrics) observe(procedure, code string, d time.Duration) {
	svc, method := "unknown", "unknown"
	if parts := strings.Split(strings.TrimPrefix(procedure, "/"), "/"); len(parts) == 2 {
		svc, method = strings.TrimPrefix(parts[0], "sluice.admin.v1."), parts[1]
	}
	m.rpcs.WithLabelValues(svc, method, code).Inc()
	m.duration.WithLabelValues(svc).Observe(d.Seconds())
}

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}
