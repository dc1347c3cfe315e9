// Package gateway is the HTTP surface of the data plane (SPEC §7): POST
// /v1/chat/completions, /v1/completions, /v1/embeddings and GET /v1/models.
//
// pipeline.go runs one request's stages top to bottom, each a call into
// the package that owns the step: readiness gate (503) → authentication
// (authn, 401/403) → attribution headers (400), the end customer's block
// and allowed routes (403) → bounded body read (413/408/400/429/503, only
// now: a request without a valid key is answered from its headers) →
// parsing (openai) → model resolution through the key's then the team's
// aliases (404) and allowed models at every level (403, routing) →
// enforced parameters (400) → candidate deployments (routing: capabilities,
// tag pool, weighted order; upstream: credentials, health) → admission
// (traffic class) → limits (limits) → forwarding with one total deadline,
// retries on another deployment before the first byte, and SSE relayed
// event by event (forward.go over openai's SSE reader and upstream's
// state). Every exit path reports one access-log line and the metrics and,
// once a key is identified, one usage event to the UsageSink, exactly once
// (finish, built here only); refusals before that (readiness, a missing or
// unknown key) are only counted (sluice_proxy_preauth_refusals_total), so
// that clients without a key cannot write to the ledger.
//
// Only the fields the proxy needs are read from the body; the body is
// forwarded byte for byte except the value of "model" (the deployment's
// upstream model) and, for streams, stream_options (include_usage is
// always requested upstream; the usage-only chunk is stripped for clients
// that did not ask for it) and "priority" (a client's is removed; the
// traffic class's is set for priority-scheduling deployments, traffic.go).
//
// Imports point one way: gateway → forward, routing, upstream, limits, authn,
// catalog → openai; nothing below the gateway imports it.
package gateway

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/admission"
	"github.com/sluicegw/sluice/dataplane/internal/authn"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/forward"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/routing"
	"github.com/sluicegw/sluice/dataplane/internal/upstream"
	"github.com/sluicegw/sluice/internal/token"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// Routes.
const (
	RouteChat        = openai.RouteChat
	RouteCompletions = openai.RouteCompletions
	RouteEmbeddings  = openai.RouteEmbeddings
	RouteModels      = openai.RouteModels
)

// maxAttributionLen bounds attribution header values (bytes).
const maxAttributionLen = 256

// Defaults.
const (
	DefaultMaxBodyBytes   = 4 << 20
	DefaultRequestTimeout = 10 * time.Minute
	DefaultMaxRetries     = 2
	// DefaultAdmissionRetryInterval: a waiting request tries for a slot at
	// least this often.
	DefaultAdmissionRetryInterval = 50 * time.Millisecond
	// DefaultTTFTTimeout abandons a stream attempt that relayed nothing
	// (no first event) for this long; it is retried elsewhere when the
	// attempt budget allows.
	DefaultTTFTTimeout = 30 * time.Second
)

// UsageSink receives one usage event per request whose key the catalog
// identified (success, upstream error, rejection or client cancel),
// exactly once, from the request's goroutine. Record must not block for long: it is on the request path.
// The sink owns ev afterwards.
type UsageSink interface {
	Record(ev *usagev1.UsageEvent)
}

// Config configures a Handler.
type Config struct {
	// Catalog returns the current catalog (nil before the first one); a
	// request captures it once.
	Catalog func() *catalog.Catalog
	// Gate, when set, is asked before authentication; a non-nil Error
	// (no configuration yet, stale configuration) is the answer.
	Gate func() *openai.Error
	// Peppers hash presented keys.
	Peppers *token.Peppers
	// JWT, when set, also accepts bearer JWTs of the orgs' trusted
	// issuers (authn.Credentials picks by the credential's shape).
	JWT *authn.JWT
	// Usage receives the usage events (required).
	Usage UsageSink
	// Registerer takes the proxy's metrics (required).
	Registerer prometheus.Registerer
	// Region and InstanceID are stamped on usage events.
	Region, InstanceID string
	// MaxBodyBytes bounds request bodies (0: DefaultMaxBodyBytes).
	MaxBodyBytes int64
	// BodyReadTimeout bounds the time a request body takes to arrive (0:
	// DefaultBodyReadTimeout). It needs a server whose ResponseWriter
	// supports read deadlines (net/http's do).
	BodyReadTimeout time.Duration
	// MaxBodyReads bounds the request bodies read at once by the handler
	// (0: DefaultMaxBodyReads), MaxBodyReadsPerConn those of one
	// connection (0: DefaultMaxBodyReadsPerConn; needs ConnContext on the
	// server).
	MaxBodyReads, MaxBodyReadsPerConn int
	// RequestTimeout is the total deadline of a request across all
	// attempts, streaming included (0: DefaultRequestTimeout).
	RequestTimeout time.Duration
	// MaxRetries is how many other deployments are tried after a
	// retryable failure (connect error, 502, 503, 504) before any byte
	// reached the client (0: DefaultMaxRetries).
	MaxRetries int
	// NoRetries turns retries off (one attempt per request): the explicit
	// "off" of MaxRetries.
	NoRetries bool
	// TTFTTimeout is the TTFT deadline of a stream attempt (0:
	// DefaultTTFTTimeout); NoTTFTTimeout turns it off.
	TTFTTimeout   time.Duration
	NoTTFTTimeout bool
	// RetryBudgetRatio bounds a model group's retries to this fraction of
	// its requests over upstream.RetryBudgetWindow (0:
	// upstream.DefaultRetryBudgetRatio); RetryBudgetMin retries per window
	// are always allowed (0: upstream.DefaultRetryBudgetMin).
	RetryBudgetRatio float64
	RetryBudgetMin   int
	// MaxEjectionPercent bounds the share of a pool that ejections and
	// Retry-After parkings take out at once (0:
	// upstream.DefaultMaxEjectionPercent; 1–100).
	MaxEjectionPercent int
	// ParkMax caps a deployment's Retry-After parking (0: upstream.ParkMax).
	ParkMax time.Duration
	// EjectionBase and EjectionMax are the passive ejection backoff: the
	// first ejection, doubling up to the max while the deployment keeps
	// failing (0: upstream.EjectBase, upstream.EjectMax). A model group's
	// resilience settings override them.
	EjectionBase, EjectionMax time.Duration
	// PanicThresholdPercent: when more than this share of a pool is out
	// (ejected, parked, failing health checks), route to all of it as if
	// healthy (0: off; a model group's setting overrides it).
	PanicThresholdPercent int
	// NoStreamProbation turns the stream probation off (on by default):
	// streams to a deployment this instance has not yet seen stream
	// cleanly, or that cut a stream or was ejected since, are held back
	// from the client until one proves it (forward.Policy.Probation;
	// docs/resilience.md, "Stream probation").
	NoStreamProbation bool
	// ProfileLabels labels each request's goroutine in CPU profiles with
	// its org and key (pprof labels "org" and "key", set once the key is
	// authenticated), so that a profile splits by tenant (go tool pprof
	// -tagfocus key=...). Goroutines a request starts, such as a new
	// upstream connection's, keep its labels; the reading of a
	// connection's next request is counted under the previous one's.
	ProfileLabels bool
	// Active health checks of every engine's /health (RunHealthChecks):
	// interval, per-probe timeout, failures in a row that take a
	// deployment out and successes that bring it back (zero: the
	// upstream.Default* values); NoHealthChecks turns them off.
	HealthCheckInterval, HealthCheckTimeout  time.Duration
	HealthCheckUnhealthy, HealthCheckHealthy int
	NoHealthChecks                           bool
	// Engine metrics of the engine_load strategy (RunEngineMetrics): the
	// poll interval and the age past which a sample is ignored (zero: the
	// upstream.DefaultEngineMetrics* values); NoEngineMetrics turns the
	// polls off (engine_load groups then order by the fleet-wide
	// in-flight count alone).
	EngineMetricsInterval, EngineMetricsMaxAge time.Duration
	NoEngineMetrics                            bool
	// Transport reaches the upstreams (nil: a pooled transport without
	// compression, so SSE is never buffered by gzip).
	Transport http.RoundTripper
	// Logger takes the access log and errors (nil: discard).
	Logger *slog.Logger
	// Limiter enforces the limits of every scope in Redis (SPEC §8). Nil:
	// no limits store; every request whose scopes carry a limit is refused
	// with 503 limits_unavailable (fail closed), and deployments'
	// max_concurrency applies per instance only. Only tests run without one.
	Limiter *limits.Limiter
	// RateFallback, when set, admits requests whose only limits are rpm/tpm
	// by this instance's local share while Redis is unavailable, when every
	// level limiting the request allows it: its rate_limit_fallback is
	// "local", or empty and RateFallbackDefault is set (nil: such requests
	// fail closed too). Budget and concurrency never fall back.
	RateFallback        *limits.LocalLimiter
	RateFallbackDefault bool
	// IETFRateLimitHeaders adds the IETF RateLimit and RateLimit-Policy
	// fields to the x-ratelimit-* headers of limited answers
	// (setRateHeaders).
	IETFRateLimitHeaders bool
	// AdmissionQueues are the per-class bounds of the admission queue
	// (docs/traffic.md); the zero value queues nothing unless a model
	// group or deployment overrides a class. AdmissionRetryInterval bounds
	// how long a waiting request goes without trying for a slot (a slot
	// freed by another proxy; 0: DefaultAdmissionRetryInterval).
	AdmissionQueues        admission.Bounds
	AdmissionRetryInterval time.Duration
	// Releases carries deployment-slot release notifications between the
	// fleet's proxies (nil: a slot freed by another proxy is seen within
	// AdmissionRetryInterval).
	Releases admission.Releases
	// Alerts receives budget alerts (nil: only counted and logged).
	Alerts AlertSink
	// DefaultMaxOutputTokens is the output bound used for estimates when
	// neither the request nor the deployment sets one (0:
	// DefaultMaxOutputTokens).
	DefaultMaxOutputTokens int64
	// Affinity keeps session pins and reads fleet-wide loads (nil: no
	// session pins; prefix and session rendezvous use this instance's
	// loads).
	Affinity *affinity.Store
	// Responses remembers which deployment produced each OpenAI Responses
	// Response (previous_response_id, GET and cancel route there). Nil:
	// requests naming a Response are refused (503
	// response_store_unavailable); new Responses are served.
	Responses ResponseStore
}

// Handler serves the OpenAI endpoints.
type Handler struct {
	cfg  Config
	log  *slog.Logger
	m    *metrics
	affm *affinityMetrics
	em   *engineMetrics
	pm   *prefillMetrics
	// gateM counts prefill isolation decisions (gate.go).
	gateM *prometheus.CounterVec
	// prefill counts this proxy's prefill tokens in flight per deployment
	// (prefill.go).
	prefill prefillCounts
	sm      *sweepMetrics
	series  seriesCache
	states  upstream.States
	auth    authn.Authenticator
	fwd     *forward.Forwarder
	retries int
	// probation is the stream probation (Config.NoStreamProbation off).
	probation bool
	// profLabels holds the label context of each key seen
	// (Config.ProfileLabels): key id → context.Context.
	profLabels sync.Map
	// budget is the retry budget of every model group.
	budget *upstream.RetryBudget
	// holdCutBudget is the held cuts' own retry allowance, taken before
	// the retry budget (forward.go): its minimum per window.
	holdCutBudget *upstream.RetryBudget
	// maxEjectionPct is Config.MaxEjectionPercent with its default,
	// panicPct Config.PanicThresholdPercent.
	maxEjectionPct, panicPct int
	// defaultMaxOut is Config.DefaultMaxOutputTokens with its default.
	defaultMaxOut int64
	// settler settles the limits of finished requests (nil without a
	// Limiter; RunSettler runs it); pendingCancels counts the settlements
	// cancelling timed-out admissions.
	settler *limits.Settler
	// renewals renews the leases of live requests (renewtick.go).
	renewals renewTick
	// scopes caches the limit scopes of the current catalog (limits.go).
	scopes atomic.Pointer[scopeCache]
	// hot caches the series counted on every request (metrics.go).
	hot            hotSeries
	pendingCancels atomic.Int64
	// bodyReads counts the request bodies being read (MaxBodyReads).
	bodyReads atomic.Int64
	// inFlight counts keys' interactive requests (demotion) and am are
	// the classification metrics (traffic.go).
	inFlight admission.InFlight
	am       *admission.Metrics
	queues   *admission.Queues
}

// New validates cfg and registers the metrics.
func New(cfg Config) (*Handler, error) {
	var errs []error
	if cfg.Catalog == nil {
		errs = append(errs, errors.New("proxy: Catalog is required"))
	}
	if cfg.Peppers == nil {
		errs = append(errs, errors.New("proxy: Peppers is required"))
	}
	if cfg.Usage == nil {
		errs = append(errs, errors.New("proxy: a UsageSink is required (every request is accounted for)"))
	}
	if cfg.Registerer == nil {
		errs = append(errs, errors.New("proxy: a metrics Registerer is required"))
	}
	if cfg.MaxBodyBytes < 0 || cfg.RequestTimeout < 0 || cfg.DefaultMaxOutputTokens < 0 {
		errs = append(errs, errors.New("proxy: MaxBodyBytes and RequestTimeout must not be negative"))
	}
	if cfg.AdmissionRetryInterval < 0 {
		errs = append(errs, errors.New("proxy: AdmissionRetryInterval must not be negative"))
	}
	if cfg.MaxRetries < 0 {
		errs = append(errs, errors.New("proxy: MaxRetries must not be negative (NoRetries turns retries off)"))
	}
	if cfg.TTFTTimeout < 0 {
		errs = append(errs, errors.New("proxy: TTFTTimeout must not be negative (NoTTFTTimeout turns it off)"))
	}
	if cfg.HealthCheckInterval < 0 || cfg.HealthCheckTimeout < 0 || cfg.HealthCheckUnhealthy < 0 || cfg.HealthCheckHealthy < 0 {
		errs = append(errs, errors.New("proxy: health check settings must not be negative (NoHealthChecks turns them off)"))
	}
	if cfg.EngineMetricsInterval < 0 || cfg.EngineMetricsMaxAge < 0 {
		errs = append(errs, errors.New("proxy: engine metrics settings must not be negative (NoEngineMetrics turns the polls off)"))
	}
	if cfg.MaxEjectionPercent < 0 || cfg.MaxEjectionPercent > 100 || cfg.ParkMax < 0 {
		errs = append(errs, errors.New("proxy: MaxEjectionPercent must be within [0, 100] and ParkMax not negative"))
	}
	if cfg.EjectionBase < 0 || cfg.EjectionMax < 0 || (cfg.EjectionBase > 0 && cfg.EjectionMax > 0 && cfg.EjectionBase > cfg.EjectionMax) {
		errs = append(errs, errors.New("proxy: EjectionBase and EjectionMax must not be negative, and EjectionBase not above EjectionMax"))
	}
	if cfg.PanicThresholdPercent < 0 || cfg.PanicThresholdPercent > 100 {
		errs = append(errs, errors.New("proxy: PanicThresholdPercent must be within [0, 100]"))
	}
	if cfg.RetryBudgetRatio < 0 || cfg.RetryBudgetRatio > 1 || cfg.RetryBudgetMin < 0 {
		errs = append(errs, errors.New("proxy: RetryBudgetRatio must be within [0, 1] and RetryBudgetMin not negative"))
	}
	if cfg.BodyReadTimeout < 0 || cfg.MaxBodyReads < 0 || cfg.MaxBodyReadsPerConn < 0 {
		errs = append(errs, errors.New("proxy: BodyReadTimeout, MaxBodyReads and MaxBodyReadsPerConn must not be negative"))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.RequestTimeout == 0 {
		cfg.RequestTimeout = DefaultRequestTimeout
	}
	if cfg.BodyReadTimeout == 0 {
		cfg.BodyReadTimeout = DefaultBodyReadTimeout
	}
	if cfg.MaxBodyReads == 0 {
		cfg.MaxBodyReads = DefaultMaxBodyReads
	}
	if cfg.MaxBodyReadsPerConn == 0 {
		cfg.MaxBodyReadsPerConn = DefaultMaxBodyReadsPerConn
	}
	h := &Handler{cfg: cfg, log: cfg.Logger, retries: cfg.MaxRetries, defaultMaxOut: cfg.DefaultMaxOutputTokens, probation: !cfg.NoStreamProbation}
	if h.defaultMaxOut == 0 {
		h.defaultMaxOut = DefaultMaxOutputTokens
	}
	switch {
	case cfg.NoRetries:
		h.retries = 0
	case h.retries == 0:
		h.retries = DefaultMaxRetries
	}
	if h.log == nil {
		h.log = slog.New(slog.DiscardHandler)
	}
	h.auth = authn.Credentials{Keys: authn.VirtualKeys{Peppers: cfg.Peppers}, JWT: cfg.JWT}
	if cfg.Limiter != nil {
		h.settler = limits.NewSettler(cfg.Limiter, func() { h.m.limitsUnavailable.WithLabelValues("settle").Inc() })
		cfg.Limiter.OnCarveAlerts(h.carveAlerts)
	}
	tr := cfg.Transport
	if tr == nil {
		tr = upstream.NewTransport()
	}
	ttft := cfg.TTFTTimeout
	switch {
	case cfg.NoTTFTTimeout:
		ttft = 0
	case ttft == 0:
		ttft = DefaultTTFTTimeout
	}
	ratio, minRetries := cfg.RetryBudgetRatio, int64(cfg.RetryBudgetMin)
	if ratio == 0 {
		ratio = upstream.DefaultRetryBudgetRatio
	}
	if minRetries == 0 {
		minRetries = upstream.DefaultRetryBudgetMin
	}
	h.budget = upstream.NewRetryBudget(ratio, minRetries)
	// No request is counted in it: its allowance is its minimum alone.
	h.holdCutBudget = upstream.NewRetryBudget(ratio, minRetries)
	h.maxEjectionPct, h.panicPct = cfg.MaxEjectionPercent, cfg.PanicThresholdPercent
	if h.maxEjectionPct == 0 {
		h.maxEjectionPct = upstream.DefaultMaxEjectionPercent
	}
	parkMax := cfg.ParkMax
	if parkMax == 0 {
		parkMax = upstream.ParkMax
	}
	h.fwd = &forward.Forwarder{Client: upstream.NewClient(tr), Log: h.log, RequestTimeout: cfg.RequestTimeout, TTFTTimeout: ttft, ParkMax: parkMax, LeaseLost: errLeaseLost,
		EjectBase: cfg.EjectionBase, EjectMax: cfg.EjectionMax,
		UpstreamError: func(dep, kind string) { h.m.upstreamErrors.WithLabelValues(dep, kind).Inc() },
		Ejection:      func(dep, reason string) { h.m.ejections.WithLabelValues(dep, reason).Inc() },
		Hold:          func(dep, reason, outcome string) { h.m.streamHolds.WithLabelValues(dep, reason, outcome).Inc() },
		Probation:     func(dep, event string) { h.m.probation.WithLabelValues(dep, event).Inc() }}
	var err error
	if h.m, err = newMetrics(cfg.Registerer, h.bodyReads.Load); err != nil {
		return nil, fmt.Errorf("proxy: register metrics: %w", err)
	}
	h.series.m = h.m
	if cfg.EngineMetricsInterval == 0 {
		h.cfg.EngineMetricsInterval = upstream.DefaultEngineMetricsInterval
	}
	if cfg.EngineMetricsMaxAge == 0 {
		h.cfg.EngineMetricsMaxAge = upstream.DefaultEngineMetricsMaxAge
	}
	if h.em, err = newEngineMetrics(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("proxy: register metrics: %w", err)
	}
	if h.affm, err = newAffinityMetrics(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("proxy: register metrics: %w", err)
	}
	if h.pm, err = newPrefillMetrics(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("proxy: register metrics: %w", err)
	}
	if h.gateM, err = newGateMetric(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("proxy: register metrics: %w", err)
	}
	if h.sm, err = newSweepMetrics(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("proxy: register metrics: %w", err)
	}
	if h.am, err = admission.NewMetrics(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("proxy: register metrics: %w", err)
	}
	qm, err := admission.NewQueueMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("proxy: register metrics: %w", err)
	}
	if cfg.AdmissionRetryInterval == 0 {
		cfg.AdmissionRetryInterval = DefaultAdmissionRetryInterval
	}
	h.queues = admission.NewQueues(cfg.AdmissionRetryInterval, qm, cfg.Releases)
	return h, nil
}

// RunSettler runs the settlement worker of the limits (a long-lived
// component: the request path only queues settlements) until ctx ends.
// Drain waits for the settlements still pending; call it before ctx ends.
func (h *Handler) RunSettler(ctx context.Context) error {
	if h.settler == nil {
		<-ctx.Done()
		return nil
	}
	return h.settler.Run(ctx)
}

// Register mounts the OpenAI endpoints on mux, and an OpenAI-shaped 404/405
// for every other /v1/ path.
func (h *Handler) Register(mux *http.ServeMux) {
	for _, r := range []string{RouteChat, RouteCompletions, RouteEmbeddings} {
		mux.Handle("POST "+r, h.inference(r))
	}
	mux.HandleFunc("GET "+RouteModels, h.models)
	mux.HandleFunc("GET /health/backlog", h.backlog) // traffic.go
	h.registerProtocols(mux)                         // Anthropic Messages, OpenAI Responses (protocols.go)
	mux.HandleFunc("/v1/", func(w http.ResponseWriter, r *http.Request) {
		ensureRequestID(w)
		CloseUnreadBody(w, r)
		switch r.URL.Path {
		case RouteChat, RouteCompletions, RouteEmbeddings, RouteModels:
			openai.WriteError(w, &openai.Error{Status: http.StatusMethodNotAllowed, Type: openai.TypeInvalidRequest, Code: openai.CodeMethodNotAllowed,
				Message: fmt.Sprintf("%s does not accept %s", r.URL.Path, r.Method), NoRetry: true})
		default:
			openai.WriteError(w, &openai.Error{Status: http.StatusNotFound, Type: openai.TypeInvalidRequest, Code: openai.CodeUnknownRoute,
				Message: fmt.Sprintf("unknown route %s", r.URL.Path), NoRetry: true})
		}
	})
}

func ensureRequestID(w http.ResponseWriter) string {
	if id := w.Header().Get(openai.RequestIDHeader); id != "" {
		return id
	}
	var b [12]byte
	_, _ = rand.Read(b[:])
	id := "req_" + hex.EncodeToString(b[:])
	w.Header().Set(openai.RequestIDHeader, id)
	return id
}

// Authenticate runs the readiness gate and authenticates the request's
// bearer key from its headers, as the inference routes do: the catalog and
// the principal, or the error to answer (the principal is set with
// key_expired and *_blocked errors too).
func (h *Handler) Authenticate(r *http.Request) (*catalog.Catalog, *catalog.Principal, *openai.Error) {
	cat, e := h.gate()
	if e != nil {
		return nil, nil, e
	}
	p, e := h.authenticate(cat, r)
	return cat, p, e
}

// authenticate checks the request's credentials against cat (the one
// Authenticator, shared with /v1/auth/check through Authenticate). The
// principal is returned with key_expired and *_blocked errors too, for
// attribution.
func (h *Handler) authenticate(cat *catalog.Catalog, r *http.Request) (*catalog.Principal, *openai.Error) {
	return h.auth.Authenticate(cat, r, time.Now())
}

// gate runs the readiness gate and returns the catalog to use.
func (h *Handler) gate() (*catalog.Catalog, *openai.Error) {
	if h.cfg.Gate != nil {
		if e := h.cfg.Gate(); e != nil {
			return nil, e
		}
	}
	cat := h.cfg.Catalog()
	if cat == nil {
		return nil, openai.Unavailable(openai.CodeConfigNotLoaded, "this proxy has not loaded its configuration yet; retry shortly", time.Second)
	}
	return cat, nil
}

// modelEntry is one entry of GET /v1/models (OpenAI's Model object).
type modelEntry struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

// models lists the names the key may use: model groups and the key's and
// team's aliases whose group exists and is allowed.
func (h *Handler) models(w http.ResponseWriter, r *http.Request) {
	ensureRequestID(w)
	CloseUnreadBody(w, r)
	cat, e := h.gate()
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	p, e := h.authenticate(cat, r)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	if routes := p.Key.GetAllowedRoutes(); len(routes) > 0 && !slices.Contains(routes, RouteModels) {
		openai.WriteError(w, openai.Forbidden(openai.CodeRouteNotAllowed, "", "this key may not call "+RouteModels))
		return
	}
	names := cat.VisibleModelGroups(p.Org.GetId())
	for n := range p.Key.GetModelGroupAliases() {
		names = append(names, n)
	}
	for n := range p.Team.GetModelGroupAliases() {
		names = append(names, n)
	}
	slices.Sort(names)
	names = slices.Compact(names)
	out := struct {
		Object string       `json:"object"`
		Data   []modelEntry `json:"data"`
	}{Object: "list", Data: []modelEntry{}}
	for _, n := range names {
		g := routing.ResolveGroup(p, n)
		if !cat.ModelGroupVisible(p.Org.GetId(), g) {
			continue
		}
		if _, ok := routing.AllowedDeployments(p, nil, g, cat.Deployments(g)); ok {
			out.Data = append(out.Data, modelEntry{ID: n, Object: "model", OwnedBy: "sluice"})
		}
	}
	b, _ := json.Marshal(out)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}
