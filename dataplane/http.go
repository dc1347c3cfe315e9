package dataplane

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/configsync"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	"github.com/sluicegw/sluice/dataplane/internal/usage"
)

// RequestIDHeader is on every answer.
const RequestIDHeader = openai.RequestIDHeader

func (d *DataPlane) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", headersOnly(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) }))
	mux.HandleFunc("GET /readyz", headersOnly(d.readyz))
	mux.Handle("GET /metrics", headersOnly(promhttp.HandlerFor(d.registry, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(d.log.Handler(), slog.LevelWarn)}).ServeHTTP))
	mux.HandleFunc("/v1/auth/check", headersOnly(d.authCheck))
	d.proxy.Register(mux)
	return d.withRequestID(mux)
}

func (d *DataPlane) withRequestID(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var b [12]byte
		_, _ = rand.Read(b[:])
		w.Header().Set(RequestIDHeader, "req_"+hex.EncodeToString(b[:]))
		d.inFlight.Add(1)
		defer d.inFlight.Add(-1)
		next.ServeHTTP(w, r)
	})
}

// gate says whether requests may be served now: nil, or the 503 to answer
// (no configuration yet, or stale under the reject policy).
func (d *DataPlane) gate() *openai.Error {
	if !d.sync.Ready() {
		return openai.Unavailable(openai.CodeConfigNotLoaded, "this proxy has not loaded its configuration yet; retry shortly", time.Second)
	}
	if d.sync.Stale() && d.cfg.StalePolicy == StalePolicyReject {
		d.staleRejected.Add(1)
		return openai.Unavailable(openai.CodeStaleConfig,
			fmt.Sprintf("this proxy has not heard from the control plane for %s (max staleness %s); refusing to serve on stale configuration",
				d.sync.Staleness().Round(time.Second), d.cfg.MaxStaleness), 5*time.Second)
	}
	return nil
}

// authCheck authenticates the bearer key and describes it: the small
// HTTP surface of key authentication. It runs the readiness gate and the
// key authentication of the OpenAI endpoints (gateway.Handler
// Authenticate), so both answer the same key with the same error.
func (d *DataPlane) authCheck(w http.ResponseWriter, r *http.Request) {
	cat, p, e := d.proxy.Authenticate(r)
	switch {
	case e == nil:
	case e.Status == http.StatusForbidden:
		d.authDenied.Add(1)
	case e.Status == http.StatusUnauthorized:
		d.authRejected.Add(1)
	}
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	d.authOK.Add(1)
	out := map[string]any{"key_id": p.Key.GetId(), "org_id": p.Key.GetOrgId(), "team_id": p.Key.GetTeamId(),
		"user_id": p.Key.GetUserId(), "config_version": cat.Version, "events_seq": cat.EventsSeq}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

func (d *DataPlane) readyz(w http.ResponseWriter, _ *http.Request) {
	switch {
	case !d.sync.Ready():
		http.Error(w, "not ready: no configuration loaded", http.StatusServiceUnavailable)
	case d.sync.Stale():
		http.Error(w, fmt.Sprintf("stale: no contact with the control plane for %s", d.sync.Staleness().Round(time.Millisecond)), http.StatusServiceUnavailable)
	case d.sync.RejectingPastBound():
		r := d.sync.Rejecting()
		http.Error(w, fmt.Sprintf("not ready: rejecting control plane: %s for %s (max %s): %s", configsync.RejectingSummary(r),
			time.Since(r.GetSince().AsTime()).Round(time.Second), d.sync.MaxRejecting(), r.GetReason()), http.StatusServiceUnavailable)
	case d.redisUp.Down() != nil:
		// Limits fail closed: every request would be refused with 503
		// limits_unavailable, so the load balancer should send it elsewhere.
		http.Error(w, "not ready: "+d.redisUp.Down().String(), http.StatusServiceUnavailable)
	default:
		c := d.sync.Catalog()
		fmt.Fprintf(w, "ready: version %d, events_seq %d, staleness %s\n", c.Version, c.EventsSeq, d.sync.Staleness().Round(time.Millisecond))
	}
}

// registerMetrics registers the data plane's own series (names in
// docs/metrics.md) on d.registry, read at scrape time; the proxy registers
// its request metrics itself.
func (d *DataPlane) registerMetrics() {
	gauge := func(name, help string, f func() float64) {
		d.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, f))
	}
	counter := func(name, help string, labels prometheus.Labels, f func() int64) {
		d.registry.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return float64(f()) }))
	}
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	sync := func(f func(configsync.Stats) int64) func() int64 { return func() int64 { return f(d.sync.Stats()) } }
	use := func(f func(usage.Stats) int64) func() float64 {
		return func() float64 { return float64(f(d.usage.Stats())) }
	}
	catalogU := func(f func(c *catalog.Catalog) uint64) func() float64 {
		return func() float64 {
			if c := d.sync.Catalog(); c != nil {
				return float64(f(c))
			}
			return 0
		}
	}
	gauge("sluice_dataplane_limits_store_up", "1 while the limits store (Redis) answers its PING probe (/readyz fails otherwise).",
		func() float64 { return b2f(d.redisUp.Down() == nil) })
	gauge("sluice_dataplane_ready", "1 once a configuration snapshot is loaded.", func() float64 { return b2f(d.sync.Ready()) })
	gauge("sluice_dataplane_snapshot_version", "Config version running.", catalogU(func(c *catalog.Catalog) uint64 { return c.Version }))
	gauge("sluice_dataplane_events_seq", "Last config event applied.", catalogU(func(c *catalog.Catalog) uint64 { return c.EventsSeq }))
	gauge("sluice_dataplane_staleness_seconds", "Seconds since the last contact with the control plane.", func() float64 { return d.sync.Staleness().Seconds() })
	gauge("sluice_dataplane_stale", "1 when staleness exceeds the configured maximum.", func() float64 { return b2f(d.sync.Stale()) })
	gauge("sluice_dataplane_rejecting", "1 while the instance has refused its region's current snapshot for longer than max-rejecting (/readyz fails).",
		func() float64 { return b2f(d.sync.RejectingPastBound()) })
	gauge("sluice_dataplane_rejecting_seconds", "Seconds the instance has been refusing its region's current snapshot (0 when it runs it).",
		func() float64 { return d.sync.RejectingFor().Seconds() })
	gauge("sluice_dataplane_in_flight", "Requests in flight.", func() float64 { return float64(d.inFlight.Load()) })
	gauge("sluice_dataplane_open_connections", "Open client connections (HTTP/1.1 and h2c).", func() float64 { return float64(d.openConns.Load()) })
	counter("sluice_dataplane_snapshots_applied_total", "Snapshots applied.", nil, sync(func(s configsync.Stats) int64 { return s.SnapshotsApplied }))
	counter("sluice_dataplane_snapshots_rejected_total", "Snapshots refused (bad digest, version or encoding).", nil, sync(func(s configsync.Stats) int64 { return s.SnapshotsRejected }))
	counter("sluice_dataplane_events_applied_total", "Config events applied.", nil, sync(func(s configsync.Stats) int64 { return s.EventsApplied }))
	counter("sluice_dataplane_events_skipped_total", "Config events skipped (already in the snapshot or duplicates).", nil, sync(func(s configsync.Stats) int64 { return s.EventsSkipped }))
	counter("sluice_dataplane_resyncs_total", "Restarts of config sync (gaps, disconnects).", nil, sync(func(s configsync.Stats) int64 { return s.Resyncs }))
	counter("sluice_dataplane_stale_rejections_total", "Requests refused with stale_config.", nil, d.staleRejected.Load)
	const authHelp = "Key authentications of /v1/auth/check by result."
	counter("sluice_dataplane_auth_total", authHelp, prometheus.Labels{"result": "ok"}, d.authOK.Load)
	counter("sluice_dataplane_auth_total", authHelp, prometheus.Labels{"result": "denied"}, d.authDenied.Load)
	counter("sluice_dataplane_auth_total", authHelp, prometheus.Labels{"result": "rejected"}, d.authRejected.Load)
	gauge("sluice_usage_buffer_depth", "Usage events in memory waiting for JetStream.", use(func(s usage.Stats) int64 { return s.Buffered }))
	gauge("sluice_usage_buffer_capacity", "Size of the usage-event buffer.", use(func(s usage.Stats) int64 { return s.BufferCapacity }))
	gauge("sluice_usage_spool_bytes", "Bytes of usage events in the on-disk spool.", use(func(s usage.Stats) int64 { return s.SpoolBytes }))
	usageCounter := func(name, help string, f func(usage.Stats) int64) {
		counter(name, help, nil, func() int64 { return f(d.usage.Stats()) })
	}
	usageCounter("sluice_usage_published_total", "Usage events acknowledged by JetStream.", func(s usage.Stats) int64 { return s.Published })
	usageCounter("sluice_usage_messages_published_total", "JetStream messages of usage events acknowledged (a batch is one).", func(s usage.Stats) int64 { return s.Messages })
	usageCounter("sluice_usage_retries_total", "Usage event publishes retried after a failure.", func(s usage.Stats) int64 { return s.Retries })
	usageCounter("sluice_usage_spooled_total", "Usage events written to the spool (buffer full or shutdown).", func(s usage.Stats) int64 { return s.Spooled })
	usageCounter("sluice_usage_replayed_total", "Spooled usage events published.", func(s usage.Stats) int64 { return s.Replayed })
	usageCounter("sluice_usage_dropped_total", "Usage events lost: buffer full and spool unavailable (each logged).", func(s usage.Stats) int64 { return s.Dropped })
	if pipe := d.rdb.Pipe; pipe != nil {
		store := func(f func(redispipe.Stats) int64) func() int64 { return func() int64 { return f(pipe.Stats()) } }
		counter("sluice_limits_store_commands_total", "Commands sent to the limits store (one Redis).", nil,
			store(func(s redispipe.Stats) int64 { return s.Commands }))
		counter("sluice_limits_store_writes_total", "Writes to the limits store; commands ÷ writes is how many commands share one (pipelining).", nil,
			store(func(s redispipe.Stats) int64 { return s.Writes }))
		counter("sluice_limits_store_connects_total", "Connections made to the limits store.", nil,
			store(func(s redispipe.Stats) int64 { return s.Dials }))
	}
	d.registerSeedMetrics()
	d.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
}
