package dataplane

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/authn"
)

// RequestIDHeader is on every answer.
const RequestIDHeader = "X-Sluice-Request-Id"

func (d *DataPlane) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", d.readyz)
	mux.HandleFunc("GET /metrics", d.metrics)
	mux.HandleFunc("/v1/auth/check", d.authCheck)
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

// apiError is the OpenAI error shape (SPEC §9.1).
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    string  `json:"code"`
}

func writeError(w http.ResponseWriter, status int, typ, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	if status == http.StatusUnauthorized || status == http.StatusForbidden {
		w.Header().Set("X-Should-Retry", "false")
	}
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]apiError{"error": {Message: msg, Type: typ, Code: code}})
}

// serving reports whether requests may be served now, answering 503 when
// not (no configuration yet, or stale under the reject policy).
func (d *DataPlane) serving(w http.ResponseWriter) bool {
	if !d.sync.Ready() {
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, "service_unavailable", "config_not_loaded",
			"this proxy has not loaded its configuration yet; retry shortly")
		return false
	}
	if d.sync.Stale() && d.cfg.StalePolicy == StalePolicyReject {
		d.staleRejected.Add(1)
		w.Header().Set("Retry-After", "5")
		writeError(w, http.StatusServiceUnavailable, "service_unavailable", "stale_config",
			fmt.Sprintf("this proxy has not heard from the control plane for %s (max staleness %s); refusing to serve on stale configuration",
				d.sync.Staleness().Round(time.Second), d.cfg.MaxStaleness))
		return false
	}
	return true
}

// authCheck authenticates the bearer key and describes it: the small
// HTTP surface of key authentication (the OpenAI endpoints build on it).
func (d *DataPlane) authCheck(w http.ResponseWriter, r *http.Request) {
	if !d.serving(w) {
		return
	}
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || tok == "" {
		d.authRejected.Add(1)
		writeError(w, http.StatusUnauthorized, "invalid_request_error", "missing_api_key",
			"no API key: send Authorization: Bearer sk-sluice-...")
		return
	}
	cat := d.sync.Catalog()
	p, err := cat.Authenticate(d.peppers, tok, time.Now())
	var blocked *authn.BlockedError
	switch {
	case err == nil:
	case errors.As(err, &blocked):
		d.authDenied.Add(1)
		writeError(w, http.StatusForbidden, "permission_error", blocked.Scope+"_blocked",
			"access denied: the "+blocked.Scope+" of this key is blocked")
		return
	case errors.Is(err, authn.ErrExpired):
		d.authRejected.Add(1)
		writeError(w, http.StatusUnauthorized, "invalid_request_error", "key_expired", "this API key has expired")
		return
	case errors.Is(err, authn.ErrMalformed):
		d.authRejected.Add(1)
		writeError(w, http.StatusUnauthorized, "invalid_request_error", "invalid_api_key",
			"the API key is malformed or mistyped (checksum mismatch)")
		return
	default:
		d.authRejected.Add(1)
		writeError(w, http.StatusUnauthorized, "invalid_request_error", "invalid_api_key", "unknown or deleted API key")
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
	default:
		c := d.sync.Catalog()
		fmt.Fprintf(w, "ready: version %d, events_seq %d, staleness %s\n", c.Version, c.EventsSeq, d.sync.Staleness().Round(time.Millisecond))
	}
}

// metrics writes Prometheus text exposition (names in docs/metrics.md).
func (d *DataPlane) metrics(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	st := d.sync.Stats()
	var version, eventsSeq uint64
	ready := 0
	if c := d.sync.Catalog(); c != nil {
		version, eventsSeq, ready = c.Version, c.EventsSeq, 1
	}
	stale := 0
	if d.sync.Stale() {
		stale = 1
	}
	g := func(name, help string, v string) {
		fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s gauge\n%s %s\n", name, help, name, name, v)
	}
	c := func(name, help string, v int64) {
		fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s counter\n%s %d\n", name, help, name, name, v)
	}
	g("sluice_dataplane_ready", "1 once a configuration snapshot is loaded.", strconv.Itoa(ready))
	g("sluice_dataplane_snapshot_version", "Config version running.", strconv.FormatUint(version, 10))
	g("sluice_dataplane_events_seq", "Last config event applied.", strconv.FormatUint(eventsSeq, 10))
	g("sluice_dataplane_staleness_seconds", "Seconds since the last contact with the control plane.", strconv.FormatFloat(d.sync.Staleness().Seconds(), 'f', 3, 64))
	g("sluice_dataplane_stale", "1 when staleness exceeds the configured maximum.", strconv.Itoa(stale))
	g("sluice_dataplane_in_flight", "Requests in flight.", strconv.FormatInt(d.inFlight.Load(), 10))
	c("sluice_dataplane_snapshots_applied_total", "Snapshots applied.", st.SnapshotsApplied)
	c("sluice_dataplane_snapshots_rejected_total", "Snapshots refused (bad digest, version or encoding).", st.SnapshotsRejected)
	c("sluice_dataplane_events_applied_total", "Config events applied.", st.EventsApplied)
	c("sluice_dataplane_events_skipped_total", "Config events skipped (already in the snapshot or duplicates).", st.EventsSkipped)
	c("sluice_dataplane_resyncs_total", "Restarts of config sync (gaps, disconnects).", st.Resyncs)
	c("sluice_dataplane_stale_rejections_total", "Requests refused with stale_config.", d.staleRejected.Load())
	fmt.Fprintf(w, "# HELP sluice_dataplane_auth_total Key authentications by result.\n# TYPE sluice_dataplane_auth_total counter\n")
	fmt.Fprintf(w, "sluice_dataplane_auth_total{result=\"ok\"} %d\n", d.authOK.Load())
	fmt.Fprintf(w, "sluice_dataplane_auth_total{result=\"denied\"} %d\n", d.authDenied.Load())
	fmt.Fprintf(w, "sluice_dataplane_auth_total{result=\"rejected\"} %d\n", d.authRejected.Load())
}
