// Package proxy serves the OpenAI-compatible endpoints of the data plane
// (SPEC §7): POST /v1/chat/completions, /v1/completions, /v1/embeddings
// and GET /v1/models.
//
// A request goes: bounded body read (413/400) → readiness gate (503) →
// key authentication from the in-memory catalog (401/403) → attribution
// headers (400) and the end customer's block (403) → allowed
// routes → model resolution through the key's then the team's aliases
// (404) → allowed models at every level (403) → enforced parameters (400)
// → candidate deployments (capabilities, credentials, tag pool, health,
// weighted shuffle, per-instance max_concurrency) → forwarding with one
// total deadline, retries on another deployment before the first byte,
// and SSE relayed event by event. Every exit path reports one usage event
// to the UsageSink, one access-log line and the metrics, exactly once.
//
// Only the fields the proxy needs are read from the body; the body is
// forwarded byte for byte except the value of "model" (the deployment's
// upstream model) and, for streams, stream_options (include_usage is
// always requested upstream; the usage-only chunk is stripped for clients
// that did not ask for it).
package proxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/dataplane/internal/authn"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/internal/token"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// Routes.
const (
	RouteChat        = "/v1/chat/completions"
	RouteCompletions = "/v1/completions"
	RouteEmbeddings  = "/v1/embeddings"
	RouteModels      = "/v1/models"
)

// RequestIDHeader carries the request id on every answer; the data
// plane's middleware sets it, the proxy sets one when it is missing.
const RequestIDHeader = "X-Sluice-Request-Id"

// Attribution headers (SPEC §9.2). They are for attribution only and never
// grant anything. The body's "user" field is never used for attribution:
// keys carry no setting that would allow it, and a client-chosen body
// field must not be able to move spend between customers.
const (
	HeaderEndUser = "X-Sluice-End-User"
	HeaderAgentID = "X-Sluice-Agent-Id"
	HeaderSession = "X-Session-Id"
	// maxAttributionLen bounds attribution header values (bytes).
	maxAttributionLen = 256
)

// Defaults.
const (
	DefaultMaxBodyBytes   = 4 << 20
	DefaultRequestTimeout = 10 * time.Minute
	DefaultMaxRetries     = 2
	// maxResponseBytes bounds a non-streaming upstream answer held in
	// memory (large embedding batches fit).
	maxResponseBytes = 64 << 20
	// dialTimeout bounds connecting to an upstream; a refused or
	// unreachable engine fails fast and the request moves on.
	dialTimeout = 5 * time.Second
)

// UsageSink receives one usage event per request (success, upstream
// error, rejection or client cancel), exactly once, from the request's
// goroutine. Record must not block for long: it is on the request path.
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
	Gate func() *Error
	// Peppers hash presented keys.
	Peppers *token.Peppers
	// Usage receives the usage events (required).
	Usage UsageSink
	// Registerer takes the proxy's metrics (required).
	Registerer prometheus.Registerer
	// Region and InstanceID are stamped on usage events.
	Region, InstanceID string
	// MaxBodyBytes bounds request bodies (0: DefaultMaxBodyBytes).
	MaxBodyBytes int64
	// RequestTimeout is the total deadline of a request across all
	// attempts, streaming included (0: DefaultRequestTimeout).
	RequestTimeout time.Duration
	// MaxRetries is how many other deployments are tried after a
	// retryable failure (connect error, 502, 503, 504) before any byte
	// reached the client (0: DefaultMaxRetries; negative: none).
	MaxRetries int
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
	// Alerts receives budget alerts (nil: only counted and logged).
	Alerts AlertSink
	// DefaultMaxOutputTokens is the output bound used for estimates when
	// neither the request nor the deployment sets one (0:
	// DefaultMaxOutputTokens).
	DefaultMaxOutputTokens int64
}

// Handler serves the OpenAI endpoints.
type Handler struct {
	cfg     Config
	log     *slog.Logger
	m       *metrics
	series  seriesCache
	states  states
	client  *http.Client
	retries int
	// defaultMaxOut is Config.DefaultMaxOutputTokens with its default.
	defaultMaxOut int64
	// pending counts settlements not yet done (Drain waits for them);
	// pendingCancels those cancelling timed-out admissions.
	pending        pendingCount
	pendingCancels atomic.Int64
	// settleQ feeds the settlement worker; settling is set while it runs.
	settleQ  chan settleJob
	settling atomic.Bool
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
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.RequestTimeout == 0 {
		cfg.RequestTimeout = DefaultRequestTimeout
	}
	h := &Handler{cfg: cfg, log: cfg.Logger, retries: cfg.MaxRetries, defaultMaxOut: cfg.DefaultMaxOutputTokens,
		settleQ: make(chan settleJob, settleQueueLen)}
	if h.defaultMaxOut == 0 {
		h.defaultMaxOut = DefaultMaxOutputTokens
	}
	switch {
	case h.retries == 0:
		h.retries = DefaultMaxRetries
	case h.retries < 0:
		h.retries = 0
	}
	if h.log == nil {
		h.log = slog.New(slog.DiscardHandler)
	}
	tr := cfg.Transport
	if tr == nil {
		tr = &http.Transport{
			DialContext:         (&net.Dialer{Timeout: dialTimeout, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:        1024,
			MaxIdleConnsPerHost: 256,
			IdleConnTimeout:     90 * time.Second,
			DisableCompression:  true,
		}
	}
	h.client = &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	var err error
	if h.m, err = newMetrics(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("proxy: register metrics: %w", err)
	}
	h.series.m = h.m
	return h, nil
}

// Register mounts the OpenAI endpoints on mux, and an OpenAI-shaped 404/405
// for every other /v1/ path.
func (h *Handler) Register(mux *http.ServeMux) {
	for _, r := range []string{RouteChat, RouteCompletions, RouteEmbeddings} {
		mux.Handle("POST "+r, h.inference(r))
	}
	mux.HandleFunc("GET "+RouteModels, h.models)
	mux.HandleFunc("/v1/", func(w http.ResponseWriter, r *http.Request) {
		ensureRequestID(w)
		switch r.URL.Path {
		case RouteChat, RouteCompletions, RouteEmbeddings, RouteModels:
			WriteError(w, &Error{Status: http.StatusMethodNotAllowed, Type: TypeInvalidRequest, Code: CodeMethodNotAllowed,
				Message: fmt.Sprintf("%s does not accept %s", r.URL.Path, r.Method), NoRetry: true})
		default:
			WriteError(w, &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Code: CodeUnknownRoute,
				Message: fmt.Sprintf("unknown route %s", r.URL.Path), NoRetry: true})
		}
	})
}

func ensureRequestID(w http.ResponseWriter) string {
	if id := w.Header().Get(RequestIDHeader); id != "" {
		return id
	}
	var b [12]byte
	_, _ = rand.Read(b[:])
	id := "req_" + hex.EncodeToString(b[:])
	w.Header().Set(RequestIDHeader, id)
	return id
}

// authenticate checks the bearer key against cat. The principal is
// returned with key_expired and *_blocked errors too, for attribution.
func (h *Handler) authenticate(cat *catalog.Catalog, r *http.Request) (*catalog.Principal, *Error) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || tok == "" {
		return nil, unauthorized(CodeMissingAPIKey, "no API key: send Authorization: Bearer sk-sluice-...")
	}
	p, err := cat.Authenticate(h.cfg.Peppers, tok, time.Now())
	var blocked *authn.BlockedError
	switch {
	case err == nil:
		return p, nil
	case errors.As(err, &blocked):
		return p, forbidden(blocked.Scope+"_blocked", "", "access denied: the "+blocked.Scope+" of this key is blocked")
	case errors.Is(err, authn.ErrExpired):
		return p, unauthorized(CodeKeyExpired, "this API key has expired")
	case errors.Is(err, authn.ErrMalformed):
		return nil, unauthorized(CodeInvalidAPIKey, "the API key is malformed or mistyped (checksum mismatch)")
	}
	return nil, unauthorized(CodeInvalidAPIKey, "unknown or deleted API key")
}

// gate runs the readiness gate and returns the catalog to use.
func (h *Handler) gate() (*catalog.Catalog, *Error) {
	if h.cfg.Gate != nil {
		if e := h.cfg.Gate(); e != nil {
			return nil, e
		}
	}
	cat := h.cfg.Catalog()
	if cat == nil {
		return nil, unavailable("config_not_loaded", "this proxy has not loaded its configuration yet; retry shortly", time.Second)
	}
	return cat, nil
}

// exchange is one inference request from arrival to settlement.
type exchange struct {
	h       *Handler
	route   string
	id      string
	start   time.Time
	req     *request
	p       *catalog.Principal
	group   string
	dep     *catalog.Deployment
	status  int
	errCode string

	customer, agent, session string

	attempts int
	// upstreamAnswered is set once an upstream sent response headers
	// (its tokens may be charged from then on).
	upstreamAnswered bool
	usageSeen        bool
	prompt           int64
	completion       int64
	cached           int64
	// contentChunks counts relayed stream chunks carrying text: the
	// completion tokens seen when a stream ends without usage.
	contentChunks int64
	ttft          time.Duration

	// cust is the end customer's record when the org knows it.
	cust *configv1.Customer
	// Limits: the admission lease (nil: nothing to settle in Redis), the
	// fallback admission, the token estimate, the live leases renewed
	// while the request runs, and the renewal's stop and abort.
	lease     *limits.Lease
	localReq  *limits.Request
	estTokens int64
	leases    liveLeases
	renewal   *renewal
	abort     context.CancelCauseFunc
}

func (h *Handler) inference(route string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		x := &exchange{h: h, route: route, start: time.Now(), id: ensureRequestID(w)}
		defer x.finish()
		if e := x.serve(w, r); e != nil {
			x.fail(w, e)
		}
	})
}

// fail answers e (unless the client is gone) and records it.
func (x *exchange) fail(w http.ResponseWriter, e *Error) {
	x.status, x.errCode = e.Status, e.Code
	if e.Status != StatusClientClosed {
		WriteError(w, e)
	}
}

func (x *exchange) serve(w http.ResponseWriter, r *http.Request) *Error {
	h := x.h
	if r.ContentLength > h.cfg.MaxBodyBytes {
		return tooLarge(h.cfg.MaxBodyBytes)
	}
	body, e := readBody(w, r, h.cfg.MaxBodyBytes)
	if e != nil {
		return e
	}
	if x.req, e = parseRequest(body); e != nil {
		return e
	}
	cat, e := h.gate()
	if e != nil {
		return e
	}
	if x.p, e = h.authenticate(cat, r); e != nil {
		return e
	}
	if e = x.attribution(r.Header); e != nil {
		return e
	}
	if e = x.customerBlocked(cat); e != nil {
		return e
	}
	if routes := x.p.Key.GetAllowedRoutes(); len(routes) > 0 && !slices.Contains(routes, x.route) {
		return forbidden(CodeRouteNotAllowed, "", fmt.Sprintf("this key may not call %s", x.route))
	}
	group := resolveGroup(x.p, x.req.model)
	if !cat.HasModelGroup(group) {
		return &Error{Status: http.StatusNotFound, Type: TypeNotFound, Code: CodeModelNotFound, Param: "model", NoRetry: true,
			Message: fmt.Sprintf("the model %q does not exist", x.req.model)}
	}
	x.group = group
	deps, ok := allowedDeployments(x.p, x.cust, group, cat.Deployments(group))
	if !ok {
		return forbidden(CodeModelNotAllowed, "model", fmt.Sprintf("this key may not use the model %q", x.req.model))
	}
	for _, param := range x.p.Key.GetEnforcedParams() {
		if !x.req.has(param) {
			return invalidRequest(CodeMissingRequiredParam, param,
				fmt.Sprintf("this key requires the parameter %q in every request", param))
		}
	}
	cands, e := h.candidates(x.route, x.req, x.p, group, deps)
	if e != nil {
		return e
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.cfg.RequestTimeout)
	defer cancel()
	ctx, x.abort = context.WithCancelCause(ctx)
	defer x.abort(nil)
	if e := x.admit(ctx, w, cat, cands); e != nil {
		return e
	}
	if x.lease != nil {
		x.leases.main = x.lease
		x.startRenewal()
	}
	return x.forward(ctx, r.Context(), w, cands)
}

func tooLarge(limit int64) *Error {
	return &Error{Status: http.StatusRequestEntityTooLarge, Type: TypeInvalidRequest, Code: CodeRequestTooLarge, NoRetry: true,
		Message: fmt.Sprintf("the request body exceeds the limit of %d bytes", limit)}
}

func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, *Error) {
	var buf bytes.Buffer
	if r.ContentLength > 0 {
		buf.Grow(int(r.ContentLength) + 1)
	} else {
		buf.Grow(4096)
	}
	_, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, limit))
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &mbe):
		return nil, tooLarge(limit)
	case err != nil:
		return nil, &Error{Status: StatusClientClosed, Code: CodeClientClosed, Message: "reading the request body: " + err.Error()}
	}
	return buf.Bytes(), nil
}

// attribution reads the attribution headers: end customer, agent id and
// session id (x-session-id, else any x-<name>-session-id).
func (x *exchange) attribution(hd http.Header) *Error {
	x.customer, x.agent = hd.Get(HeaderEndUser), hd.Get(HeaderAgentID)
	x.session = hd.Get(HeaderSession)
	if x.session == "" {
		var names []string
		const suffix = "-session-id"
		for name := range hd {
			if len(name) > len("x-"+suffix) && strings.EqualFold(name[:2], "x-") && strings.EqualFold(name[len(name)-len(suffix):], suffix) {
				names = append(names, name)
			}
		}
		if len(names) > 0 {
			slices.Sort(names) // deterministic when several are sent
			x.session = hd.Get(names[0])
		}
	}
	for _, v := range []struct{ name, val string }{{HeaderEndUser, x.customer}, {HeaderAgentID, x.agent}, {"session id header", x.session}} {
		if len(v.val) > maxAttributionLen {
			return invalidRequest(CodeInvalidHeader, v.name, fmt.Sprintf("%s is longer than %d bytes", v.name, maxAttributionLen))
		}
		if !utf8.ValidString(v.val) {
			// Attribution is recorded in the usage ledger (UTF-8 text);
			// the refusal itself is recorded with the value repaired.
			x.customer = strings.ToValidUTF8(x.customer, "\uFFFD")
			x.agent = strings.ToValidUTF8(x.agent, "\uFFFD")
			x.session = strings.ToValidUTF8(x.session, "\uFFFD")
			return invalidRequest(CodeInvalidHeader, v.name, fmt.Sprintf("%s must be UTF-8 text", v.name))
		}
	}
	return nil
}

// customerBlocked refuses a request on behalf of a blocked end customer:
// the x-sluice-end-user value looked up among the customers of the key's
// org. A customer the org does not know is allowed (the header is for
// attribution); only a known, blocked one is refused (SPEC §4).
func (x *exchange) customerBlocked(cat *catalog.Catalog) *Error {
	if x.customer == "" {
		return nil
	}
	x.cust = cat.Customer(x.p.Key.GetOrgId(), x.customer)
	if cu := x.cust; cu != nil && cu.GetBlocked() {
		return forbidden(CodeCustomerBlocked, HeaderEndUser, "access denied: the end customer named in "+HeaderEndUser+" is blocked")
	}
	return nil
}

// finish settles the exchange exactly once: usage event, metrics, access
// log. It runs on every exit path (deferred), panics included.
func (x *exchange) finish() {
	h := x.h
	if x.status == 0 {
		x.status, x.errCode = http.StatusInternalServerError, "internal_error"
	}
	elapsed := time.Since(x.start)
	if !x.usageSeen && x.upstreamAnswered && x.req != nil {
		// The stream ended before its usage chunk (client cancel, cut):
		// charge what was seen.
		x.prompt, x.completion = x.req.promptEstimate, x.contentChunks
	}
	ev := &usagev1.UsageEvent{
		RequestId: x.id, Time: timestamppb.New(x.start), Region: h.cfg.Region, InstanceId: h.cfg.InstanceID,
		Customer: x.customer, AgentId: x.agent, SessionId: x.session, Route: x.route, ModelGroup: x.group,
		PromptTokens: x.prompt, CompletionTokens: x.completion, CachedTokens: x.cached,
		Status: int32(x.status), ErrorCode: x.errCode, LatencyMs: elapsed.Milliseconds(), TtftMs: x.ttft.Milliseconds(),
		Attempts: int32(x.attempts),
	}
	if x.req != nil {
		ev.RequestedModel, ev.Stream = x.req.model, x.req.stream
	}
	if p := x.p; p != nil {
		ev.KeyId, ev.UserId, ev.TeamId, ev.OrgId, ev.Project = p.Key.GetId(), p.Key.GetUserId(), p.Key.GetTeamId(), p.Key.GetOrgId(), p.Key.GetProject()
		ev.Tags = p.Key.GetTags()
		ev.TrafficClass = trafficClass(p)
	}
	if d := x.dep; d != nil {
		ev.DeploymentId = d.GetId()
		ev.CostUsd = cost(d.GetPrices(), x.prompt, x.cached, x.completion)
	}
	h.cfg.Usage.Record(ev)
	x.stopRenewal()
	x.releaseDeploymentLease()
	if x.lease != nil || x.localReq != nil {
		x.settleLeases(x.prompt+x.completion, ev.CostUsd)
	}

	h.series.requests(x.route, x.group, x.status).Inc()
	g := h.series.group(x.group)
	g.duration.Observe(elapsed.Seconds())
	if x.ttft > 0 {
		g.ttft.Observe(x.ttft.Seconds())
	}
	if !h.log.Enabled(context.Background(), slog.LevelInfo) {
		return
	}
	h.log.LogAttrs(context.Background(), slog.LevelInfo, "request",
		slog.String("request_id", x.id), slog.String("route", x.route),
		slog.String("key_id", ev.KeyId), slog.String("org_id", ev.OrgId), slog.String("team_id", ev.TeamId),
		slog.String("model_group", x.group), slog.String("deployment", ev.DeploymentId),
		slog.Int("status", x.status), slog.String("error_code", x.errCode), slog.Bool("stream", ev.Stream),
		slog.Int64("duration_ms", ev.LatencyMs), slog.Int64("ttft_ms", ev.TtftMs), slog.Int("attempts", x.attempts),
		slog.Int64("prompt_tokens", x.prompt), slog.Int64("completion_tokens", x.completion))
}

// cost prices a request: uncached prompt tokens at the input price, cached
// ones at the cached-input price when the deployment sets one (else the
// input price), completion tokens at the output price. Free deployments
// have zero prices.
func cost(p *configv1.Prices, prompt, cached, completion int64) float64 {
	cached = min(cached, prompt)
	cachedPrice := p.GetCachedInputPerToken()
	if cachedPrice == 0 {
		cachedPrice = p.GetInputPerToken()
	}
	return float64(prompt-cached)*p.GetInputPerToken() + float64(cached)*cachedPrice + float64(completion)*p.GetOutputPerToken()
}

func trafficClass(p *catalog.Principal) string {
	tc := p.Key.GetTrafficClass()
	if tc == configv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED {
		tc = p.Team.GetTrafficClass()
	}
	if tc == configv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED {
		return ""
	}
	return strings.ToLower(strings.TrimPrefix(tc.String(), "TRAFFIC_CLASS_"))
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
	cat, e := h.gate()
	if e != nil {
		WriteError(w, e)
		return
	}
	p, e := h.authenticate(cat, r)
	if e != nil {
		WriteError(w, e)
		return
	}
	if routes := p.Key.GetAllowedRoutes(); len(routes) > 0 && !slices.Contains(routes, RouteModels) {
		WriteError(w, forbidden(CodeRouteNotAllowed, "", "this key may not call "+RouteModels))
		return
	}
	names := cat.ModelGroups()
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
		g := resolveGroup(p, n)
		if !cat.HasModelGroup(g) {
			continue
		}
		if _, ok := allowedDeployments(p, nil, g, cat.Deployments(g)); ok {
			out.Data = append(out.Data, modelEntry{ID: n, Object: "model", OwnedBy: "sluice"})
		}
	}
	b, _ := json.Marshal(out)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}

// drain discards the rest of an upstream body (bounded) so its connection
// can be reused.
func drain(rc io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(rc, 64<<10))
	_ = rc.Close()
}
