package gateway

// pipeline.go runs one exchange (an inference request) from arrival to
// settlement, stage by stage, each stage a call into the package that
// owns it:
//
//	gate          h.gate                    readiness (configsync via Config.Gate)
//	authenticate  h.authenticate            authn.Authenticator over the catalog
//	attribute     x.attribute               attribution headers, end customer, allowed routes
//	read body     x.readBody                bounded read (bodyread.go)
//	parse         openai.ParseRequest       the wire format
//	resolve       x.resolve                 routing.ResolveGroup, routing.AllowedDeployments
//	candidates    h.candidates              routing.Filter/TagPool/WeightedShuffle, upstream health
//	admission     x.admission               traffic class (the hook of class queues)
//	limits        x.admit                   limits.Limiter (limits.go), with the affinity
//	                                        lookup alongside (affinity.go)
//	order         x.orderCandidates         session pin, prefix rendezvous, bounded load
//	forward       x.forward                 attempts and relay (forward.go), upstream state
//	settle        x.finish                  usage event, metrics, access log, limits settlement
//
// The body is read after authentication and attribution, not first: a
// request without a valid key is answered from its headers and its body is
// never read, so clients without a key cannot hold body-read capacity
// (docs/proxy.md, "Bodies and timeouts").

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/pprof"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/routing"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// exchange is one inference request from arrival to settlement.
type exchange struct {
	h     *Handler
	route string
	// proto is the route's wire protocol (protocols.go).
	proto   *protocol
	id      string
	start   time.Time
	req     *openai.Request
	p       *catalog.Principal
	group   string
	dep     *catalog.Deployment
	status  int
	errCode string

	customer, agent, session string
	// bodyRead is set once the request body was read whole.
	bodyRead bool

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
	// holds are the held streams of the request's attempts
	// ("reason:outcome", comma-separated; the access log's stream_hold),
	// held the time the answering attempt's first event was held back.
	holds string
	held  time.Duration

	// cust is the end customer's record when the org knows it.
	cust *configv1.Customer
	// labels are the project and tag scopes of the key (attribute).
	labels []*configv1.LabelScope
	// class is the traffic class (the admission stage, traffic.go), by
	// name and value, and the reason it was chosen; countedInteractive is
	// set while the request counts among its key's interactive requests
	// in flight.
	class              string
	classEnum          configv1.TrafficClass
	classReason        string
	countedInteractive bool
	// charged is set once the exchange's estimated cost chargedCost was
	// counted as served to its team (traffic.go, chargeServed).
	charged     bool
	chargedCost float64
	// cat is the catalog the request was classified with; shed is set
	// when no deployment slot was found (queue full, timeout, no queue):
	// the admission is then cancelled, consuming nothing.
	cat  *catalog.Catalog
	shed bool
	// Limits: the admission lease (nil: nothing to settle in Redis), the
	// fallback admission, the token estimate, the live leases renewed
	// while the request runs, and the renewal's stop and abort.
	lease     *limits.Lease
	localReq  *limits.Request
	estTokens int64
	// scopesChecked: the request's scopes came from the handler's cache,
	// checked by limits.PrepareScopes when cached.
	scopesChecked bool
	leases        liveLeases
	renewal       *renewal
	renewalV      renewal // what renewal points to (one allocation less per request)
	abort         context.CancelCauseFunc
	// prog is what renewals report of the request, lostPrices the prices
	// of its report before it is forwarded (lease.go).
	prog       progress
	lostPrices *configv1.Prices
	// lostPricesV is what lostPrices points to (one allocation less).
	lostPricesV configv1.Prices
	// aff is the request's affinity (affinity.go), rt its group's routing
	// strategy (strategy.go), pf the current attempt's prefill (prefill.go).
	aff affinityState
	rt  groupRouting
	pf  prefillAttempt
	// gateWaited: a prefill isolation gate refused one of the request's
	// attempts on a deployment (gate.go; the access log's prefill_gate).
	gateWaited bool
	// Responses (protocols.go): the deployment a previous_response_id
	// pins the request to, the id of the Response produced.
	pinned     string
	responseID string
	// cacheCreation are the prompt tokens the engine wrote to its prompt
	// cache (Anthropic's cache_creation_input_tokens).
	cacheCreation int64
	// skipped are the groups of the fallback chain that could not serve
	// the request, and why (fallback.go).
	skipped []skippedGroup
}

func (h *Handler) inference(route string) http.Handler { return h.serve(route, &openAIProtocol) }

// serve runs the exchanges of route in protocol p.
func (h *Handler) serve(route string, p *protocol) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w = p.wrap(w)
		x := &exchange{h: h, route: route, proto: p, start: time.Now(), id: ensureRequestID(w)}
		defer x.finish()
		if e := x.run(w, r); e != nil {
			if !x.bodyRead {
				CloseUnreadBody(w, r)
			}
			x.fail(w, e)
		}
	})
}

// fail answers e (unless the client is gone) and records it.
func (x *exchange) fail(w http.ResponseWriter, e *openai.Error) {
	x.status, x.errCode = e.Status, e.Code
	if e.Status != openai.StatusClientClosed {
		x.proto.writeError(w, e)
	}
}

// run runs the stages of one exchange in order; the first refusal is the
// answer. finish (deferred by inference) settles it on every exit path.
func (x *exchange) run(w http.ResponseWriter, r *http.Request) *openai.Error {
	h := x.h
	// Everything that needs only the headers runs before the body is read.
	cat, e := h.gate() // ready gate
	if e != nil {
		return e
	}
	if x.p, e = x.proto.authenticate(h, cat, r); e != nil { // authenticate (authn)
		return e
	}
	if h.cfg.ProfileLabels {
		h.labelGoroutine(x.p.Key)
	}
	if e = x.attribute(cat, r.Header); e != nil { // attribute (headers, end customer, route)
		return e
	}
	body, e := x.readBody(w, r) // read body (bounded; bodyread.go)
	if e != nil {
		return e
	}
	if x.req, e = x.proto.parse(body); e != nil { // parse (openai, anthropic)
		return e
	}
	// resolve group and permissions, the route's protocol, candidates
	// (routing, upstream health), then the fallback groups' (fallback.go)
	cands, fallbacks, e := x.candidateChain(cat)
	if e != nil {
		return e
	}
	if cands, e = x.pinPrevious(r.Context(), cat, cands); e != nil { // previous_response_id (protocols.go)
		return e
	}
	if x.pinned != "" {
		fallbacks = nil // a follow-up goes where its previous response is, or nowhere
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.cfg.RequestTimeout)
	defer cancel()
	ctx, x.abort = context.WithCancelCause(ctx)
	defer x.abort(nil)
	if e := x.admission(ctx, w, cat, r.Header); e != nil { // admission (traffic class)
		return e
	}
	// Affinity and load order the healthy candidates; the last resorts
	// (ejected or parked, kept in by the maximum ejection percentage) of
	// every group come after the healthy ones of the fallbacks (route.go).
	best, rest := bestStanding(cands)
	x.startAffinity(ctx, r.Header, best) // affinity lookup, concurrent with the limits call (affinity.go)
	// limits (limits.go), estimated over every group that may serve
	if e := x.admit(ctx, w, append(cands[:len(cands):len(cands)], fallbacks...)); e != nil {
		return e
	}
	cands = x.chainOrder(cat, best, rest, fallbacks) // session pin, prefix, bounded load (affinity.go); the rest after
	if x.lease != nil {
		x.leases.main = x.lease
		x.startRenewal()
	}
	return x.forward(ctx, r.Context(), w, cands) // route and forward (forward.go)
}

// attribute reads the attribution headers, refuses a blocked end customer
// and a route the key may not call, and finds the key's project and tag
// scopes.
func (x *exchange) attribute(cat *catalog.Catalog, hd http.Header) *openai.Error {
	if e := x.attribution(hd); e != nil {
		return e
	}
	if e := x.customerBlocked(cat); e != nil {
		return e
	}
	x.labels = cat.LabelScopes(x.p.Key)
	if routes := x.p.Key.GetAllowedRoutes(); len(routes) > 0 && !slices.Contains(routes, x.route) {
		return openai.Forbidden(openai.CodeRouteNotAllowed, "", fmt.Sprintf("this key may not call %s", x.route))
	}
	return nil
}

// resolve maps the requested model to its group (aliases) and returns the
// group's deployments every level permits; it checks the key's enforced
// parameters.
func (x *exchange) resolve(cat *catalog.Catalog) ([]*catalog.Deployment, *openai.Error) {
	group := routing.ResolveGroup(x.p, x.req.Model())
	if !cat.ModelGroupVisible(x.p.Org.GetId(), group) { // exists and granted to the org (docs/tenancy.md)
		return nil, openai.ModelNotFound(x.req.Model())
	}
	x.group = group
	deps, ok := routing.AllowedDeployments(x.p, x.cust, group, cat.Deployments(group))
	if !ok {
		return nil, openai.Forbidden(openai.CodeModelNotAllowed, "model", fmt.Sprintf("this key may not use the model %q", x.req.Model()))
	}
	for _, param := range x.p.Key.GetEnforcedParams() {
		if !x.req.Has(param) {
			return nil, openai.InvalidRequest(openai.CodeMissingRequiredParam, param,
				fmt.Sprintf("this key requires the parameter %q in every request", param))
		}
	}
	return deps, nil
}

// admission is the stage where a request gets its traffic class
// (traffic.go): from the credential, the org's rules and default, and
// demotion. The class decides the deployment lease's class scopes
// (reserved slots) and the engine priority.
func (x *exchange) admission(_ context.Context, w http.ResponseWriter, cat *catalog.Catalog, hd http.Header) *openai.Error {
	x.classify(w, cat, hd)
	return nil
}

func tooLarge(limit int64) *openai.Error {
	return &openai.Error{Status: http.StatusRequestEntityTooLarge, Type: openai.TypeInvalidRequest, Code: openai.CodeRequestTooLarge, NoRetry: true,
		Message: fmt.Sprintf("the request body exceeds the limit of %d bytes", limit)}
}

// attribution reads the attribution headers: end customer, agent id and
// session id (x-session-id, else any x-<name>-session-id).
func (x *exchange) attribution(hd http.Header) *openai.Error {
	x.customer, x.agent = hd.Get(openai.HeaderEndUser), hd.Get(openai.HeaderAgentID)
	if c := x.p.Customer; c != "" {
		x.customer = c // a JWT's customer claim is the issuer's word: it wins over the header
	}
	x.session = hd.Get(openai.HeaderSession)
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
	for _, v := range []struct{ name, val string }{{openai.HeaderEndUser, x.customer}, {openai.HeaderAgentID, x.agent}, {"session id header", x.session}} {
		if len(v.val) > maxAttributionLen {
			return openai.InvalidRequest(openai.CodeInvalidHeader, v.name, fmt.Sprintf("%s is longer than %d bytes", v.name, maxAttributionLen))
		}
		if !utf8.ValidString(v.val) {
			// Attribution is recorded in the usage ledger (UTF-8 text);
			// the refusal itself is recorded with the value repaired.
			x.customer = strings.ToValidUTF8(x.customer, "\uFFFD")
			x.agent = strings.ToValidUTF8(x.agent, "\uFFFD")
			x.session = strings.ToValidUTF8(x.session, "\uFFFD")
			return openai.InvalidRequest(openai.CodeInvalidHeader, v.name, fmt.Sprintf("%s must be UTF-8 text", v.name))
		}
	}
	return nil
}

// customerBlocked refuses a request on behalf of a blocked end customer:
// the x-sluice-end-user value looked up among the customers of the key's
// org. A customer the org does not know is allowed (the header is for
// attribution); only a known, blocked one is refused (SPEC §4).
func (x *exchange) customerBlocked(cat *catalog.Catalog) *openai.Error {
	if x.customer == "" {
		return nil
	}
	x.cust = cat.Customer(x.p.Key.GetOrgId(), x.customer)
	if cu := x.cust; cu != nil && cu.GetBlocked() {
		return openai.Forbidden(openai.CodeCustomerBlocked, openai.HeaderEndUser, "access denied: the end customer named in "+openai.HeaderEndUser+" is blocked")
	}
	return nil
}

// finish settles the exchange exactly once: usage event, metrics, access
// log. It runs on every exit path (deferred), panics included.
func (x *exchange) finish() {
	h := x.h
	if x.status == 0 {
		x.status, x.errCode = http.StatusInternalServerError, openai.CodeInternal
	}
	elapsed := time.Since(x.start)
	if x.upstreamAnswered && x.req != nil {
		// A stream that ended before its final usage (client cancel, cut)
		// is charged what was seen: the prompt estimate when no usage came
		// at all, and at least one token per content chunk relayed (an
		// Anthropic stream's message_start already carries usage, with
		// output_tokens 0 or 1). A final usage always counts every chunk.
		if !x.usageSeen {
			x.prompt = x.req.PromptEstimate()
		}
		x.completion = max(x.completion, x.contentChunks)
	}
	ev := &usagev1.UsageEvent{
		RequestId: x.id, Time: timestamppb.New(x.start), Region: h.cfg.Region, InstanceId: h.cfg.InstanceID,
		Customer: x.customer, AgentId: x.agent, SessionId: x.session, Route: x.route, ModelGroup: x.group,
		PromptTokens: x.prompt, CompletionTokens: x.completion, CachedTokens: x.cached, CacheCreationTokens: x.cacheCreation,
		Status: int32(x.status), ErrorCode: x.errCode, LatencyMs: elapsed.Milliseconds(), TtftMs: x.ttft.Milliseconds(),
		Attempts: int32(x.attempts), RoutingReason: x.routingReason(),
	}
	if x.req != nil {
		ev.RequestedModel, ev.Stream = x.req.Model(), x.req.Stream()
	}
	if p := x.p; p != nil {
		ev.KeyId, ev.UserId, ev.TeamId, ev.OrgId, ev.Project = p.Key.GetId(), p.Key.GetUserId(), p.Key.GetTeamId(), p.Key.GetOrgId(), p.Key.GetProject()
		ev.Tags = p.Key.GetTags()
		ev.TrafficClass, ev.TrafficClassReason = x.class, x.classReason
		if ev.TrafficClass == "" {
			ev.TrafficClass = trafficClass(p) // refused before the admission stage
		}
	}
	if d := x.dep; d != nil {
		ev.DeploymentId, ev.ServedModelGroup = d.GetId(), d.GetModelGroup()
		ev.CostUsd = cost(d.GetPrices(), x.prompt, x.cached, x.completion)
	}
	if x.p != nil {
		h.cfg.Usage.Record(ev)
	} else {
		// Refused before a key was identified: nothing to attribute, and
		// no ledger row a client without a key could make us write.
		h.m.preauthRefusals.WithLabelValues(x.route, x.errCode).Inc()
	}
	x.settleAffinity()
	x.stopRenewal()
	x.releaseDeploymentLease()
	x.releaseClass()
	x.settleServed()
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
		slog.String("model_group", x.group), slog.String("served_model_group", ev.ServedModelGroup), slog.String("deployment", ev.DeploymentId), slog.String("routing_reason", ev.RoutingReason),
		slog.Int("status", x.status), slog.String("error_code", x.errCode), slog.Bool("stream", ev.Stream),
		slog.Int64("duration_ms", ev.LatencyMs), slog.Int64("ttft_ms", ev.TtftMs), slog.Int("attempts", x.attempts),
		slog.Int64("prompt_tokens", x.prompt), slog.Int64("completion_tokens", x.completion),
		slog.String("traffic_class", x.class), slog.String("class_reason", x.classReason), slog.Bool("prefill_gate_waited", x.gateWaited),
		slog.String("stream_hold", x.holds), slog.Int64("stream_held_ms", x.held.Milliseconds()))
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

// labelGoroutine labels the calling goroutine in CPU profiles with k's org
// and key (Config.ProfileLabels). The label context is built once per key.
func (h *Handler) labelGoroutine(k *configv1.Key) {
	c, ok := h.profLabels.Load(k.GetId())
	if !ok {
		c, _ = h.profLabels.LoadOrStore(k.GetId(),
			pprof.WithLabels(context.Background(), pprof.Labels("org", k.GetOrgId(), "key", k.GetId())))
	}
	pprof.SetGoroutineLabels(c.(context.Context))
}
