package gateway

// explain.go: the pipeline in dry run (docs/explain.md). Explain takes a
// synthetic request and runs the stages of exchange.run up to the routing
// choice with the same functions (authenticate, attribute, parse, resolve,
// protocolDeployments, candidates, pinPrevious, the classifier, limitScopes
// and estimate, startAffinity and orderCandidates), without their side
// effects on admission: no class is counted, nothing is admitted or
// reserved in Redis (headroom is read by limits.Peek), no lease is taken,
// no session is pinned and nothing is forwarded or recorded.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/authn"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/classify"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/routing"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Errors of Explain: the query names a credential the caller may not see
// (or none that exists), or is malformed.
var (
	ErrExplainNotFound = errors.New("no such credential in the caller's scope")
	ErrExplainInvalid  = errors.New("invalid explain query")
)

// ExplainScope is the admin caller's tenant scope: empty fields mean any.
type ExplainScope struct{ OrgID, TeamID string }

// explainCredentialHeaders are refused in a query's headers: credentials
// are given as key_id, token or jwt, so none hides in the headers.
var explainCredentialHeaders = []string{"Authorization", "Proxy-Authorization", "X-Api-Key", "Api-Key", "Cookie"}

// explainRoutes maps the routes Explain accepts to their protocol.
var explainRoutes = map[string]*protocol{
	RouteChat: &openAIProtocol, RouteCompletions: &openAIProtocol, RouteEmbeddings: &openAIProtocol,
	RouteMessages: &anthropicProtocol, RouteResponses: &responsesProtocol,
}

// Explain answers what the proxy would decide for q against its live
// catalog, within scope. The trace's outcome is the answer the request
// would get; a credential outside scope (or unknown, for a scoped caller)
// is ErrExplainNotFound, a malformed query wraps ErrExplainInvalid.
func (h *Handler) Explain(ctx context.Context, scope ExplainScope, q *configv1.ExplainQuery) (*configv1.ExplainTrace, error) {
	route := q.GetRoute()
	if route == "" {
		route = RouteChat
	}
	proto, ok := explainRoutes[route]
	if !ok {
		return nil, fmt.Errorf("%w: unknown route %q", ErrExplainInvalid, route)
	}
	hd := http.Header{}
	for k, v := range q.GetHeaders() {
		hd.Set(k, v)
	}
	for _, k := range explainCredentialHeaders {
		if hd.Get(k) != "" {
			return nil, fmt.Errorf("%w: header %s carries a credential: give it as token", ErrExplainInvalid, k)
		}
	}
	x := &exchange{h: h, route: route, proto: proto, id: "explain", start: time.Now()}
	tr := &configv1.ExplainTrace{Region: h.cfg.Region, InstanceId: h.cfg.InstanceID, Route: route,
		Outcome: &configv1.ExplainOutcome{}, Auth: &configv1.ExplainAuth{}}
	refuse := func(stage string, e *openai.Error) (*configv1.ExplainTrace, error) {
		tr.Outcome = &configv1.ExplainOutcome{Status: int32(e.Status), ErrorType: e.Type, ErrorCode: e.Code, Message: e.Message, Stage: stage}
		return tr, nil
	}
	cat, e := h.gate()
	if e != nil {
		return refuse("gate", e)
	}
	tr.SnapshotVersion, tr.RegionSeq = cat.Version, cat.RegionSeq

	// authenticate
	var err error
	if x.p, e, err = h.explainAuth(ctx, cat, proto, q, hd, tr.Auth); err != nil {
		return nil, err
	}
	if x.p != nil {
		k := x.p.Key
		if (scope.OrgID != "" && k.GetOrgId() != scope.OrgID) || (scope.TeamID != "" && k.GetTeamId() != scope.TeamID) {
			return nil, ErrExplainNotFound
		}
		tr.Auth.KeyId, tr.Auth.OrgId, tr.Auth.TeamId, tr.Auth.UserId = k.GetId(), k.GetOrgId(), k.GetTeamId(), k.GetUserId()
		tr.Auth.Customer = x.p.Customer
	} else if scope.OrgID != "" {
		return nil, ErrExplainNotFound // a refused credential names no org: only the platform sees why
	}
	if e != nil {
		tr.Auth.ErrorCode = e.Code
		if x.p != nil {
			tr.TrafficClass = &configv1.ExplainClass{Class: trafficClass(x.p), Reason: "refused before admission"}
		}
		return refuse("authenticate", e)
	}
	tr.Auth.Authenticated = true

	// attribute, body, parse
	if e := x.attribute(cat, hd); e != nil {
		return refuse("attribute", e)
	}
	if q.GetPromptBytes() > h.cfg.MaxBodyBytes {
		return refuse("read body", tooLarge(h.cfg.MaxBodyBytes)) // the body would be larger still
	}
	body, err := explainBody(route, q)
	if err != nil {
		return nil, err
	}
	if int64(len(body)) > h.cfg.MaxBodyBytes {
		return refuse("read body", tooLarge(h.cfg.MaxBodyBytes))
	}
	if x.req, e = proto.parse(body); e != nil {
		return refuse("parse", e)
	}

	// class (before the routing stages, as the trace reads; it does not
	// depend on them)
	tr.TrafficClass = x.explainClass(cat, hd)

	// resolve
	requested := x.req.Model()
	group := routing.ResolveGroup(x.p, requested)
	tr.Model = &configv1.ExplainModel{Requested: requested, Group: group, GroupExists: cat.HasModelGroup(group)}
	if _, ok := x.p.Key.GetModelGroupAliases()[requested]; ok {
		tr.Model.AliasSource = "key"
	} else if _, ok := x.p.Team.GetModelGroupAliases()[requested]; ok {
		tr.Model.AliasSource = "team"
	}
	all := cat.Deployments(group)
	rows := make(map[string]*configv1.ExplainDeployment, len(all))
	for _, d := range all {
		r := &configv1.ExplainDeployment{Id: d.GetId(), UpstreamModel: d.GetUpstreamModel(), Weight: d.GetWeight(), Tags: d.GetTags()}
		rows[d.GetId()] = r
		tr.Deployments = append(tr.Deployments, r)
	}
	filtered := func(deps []*catalog.Deployment, stage string, why func(*catalog.Deployment) string) {
		for _, d := range deps {
			if r := rows[d.GetId()]; r != nil && r.FilteredBy == "" {
				r.FilteredBy, r.Reason = stage, why(d)
			}
		}
	}
	allowed, _ := routing.AllowedDeployments(x.p, x.cust, group, all)
	filtered(minus(all, allowed), "allowed_models", func(d *catalog.Deployment) string {
		return fmt.Sprintf("upstream model %q (and the group) is not in the allowed_models of every level", d.GetUpstreamModel())
	})
	deps, e := x.resolve(cat)
	if e != nil {
		return refuse("resolve", e)
	}
	protoDeps, e := x.protocolDeployments(group, deps)
	filtered(minus(deps, protoDeps), "protocol", func(*catalog.Deployment) string {
		return "the deployment does not declare the protocol of " + route
	})
	if e != nil {
		return refuse("resolve", e)
	}
	reqs := routing.RequirementsOf(route, x.req)
	for _, d := range protoDeps {
		if _, fe := routing.Filter(group, reqs, []*catalog.Deployment{d}); fe != nil {
			filtered([]*catalog.Deployment{d}, "capabilities", func(*catalog.Deployment) string {
				return fmt.Sprintf("lacks what %s needs: %s", fe.Param, fe.Message)
			})
		}
	}
	// The candidates as the pipeline takes them: the group's, then its
	// fallback groups' (fallback.go).
	cands, fallbacks, e := x.candidateChain(cat)
	if e != nil {
		return refuse("candidates", e)
	}
	var usable []*catalog.Deployment
	for _, d := range protoDeps {
		if rows[d.GetId()].GetFilteredBy() != "" {
			continue
		}
		if d.CredentialErr != nil {
			filtered([]*catalog.Deployment{d}, "credential", func(*catalog.Deployment) string {
				return "its upstream credential cannot be decrypted on this data plane"
			})
			continue
		}
		usable = append(usable, d)
	}
	pool := routing.TagPool(usable, x.p.Key.GetTags())
	filtered(minus(usable, pool), "tag_pool", func(*catalog.Deployment) string {
		if len(x.p.Key.GetTags()) == 0 {
			return "tagged: the key has no tags, so it uses the untagged deployments"
		}
		return fmt.Sprintf("outside the key's tag pool (key tags %v)", x.p.Key.GetTags())
	})
	if cands, e = x.pinPrevious(ctx, cat, cands); e != nil {
		return refuse("candidates", e)
	}
	candDeps := make([]*catalog.Deployment, len(cands))
	for i, c := range cands {
		candDeps[i] = c.d
		if row := rows[c.d.GetId()]; row != nil { // nil: a fallback group's deployment
			row.Candidate = true
		}
	}
	filtered(minus(pool, candDeps), "health", func(*catalog.Deployment) string {
		return "out of rotation (ejected or parked after upstream failures), or not the deployment previous_response_id pins"
	})

	// limits (read only)
	if e := x.explainLimits(ctx, tr, cands); e != nil {
		return refuse("limits", e)
	}

	// order: the routing choice and the chain of retries elsewhere
	best, rest := bestStanding(cands)
	x.startAffinity(ctx, hd, best)
	cands = x.chainOrder(cat, best, rest, fallbacks)
	for _, c := range cands {
		if c.standing.Rank() > 0 {
			tr.Notes = append(tr.Notes, fmt.Sprintf("deployment %s is a last resort (%s, kept in rotation by the maximum ejection percentage): tried after every healthy one",
				c.d.GetId(), c.standing.Label(&c.st.Health, time.Now())))
		}
	}
	x.explainPrefill(ctx, tr, rows, cands)
	for _, sk := range x.skipped {
		tr.Notes = append(tr.Notes, fmt.Sprintf("fallback group %s skipped: %s", sk.group, sk.why))
	}
	rt := &configv1.ExplainRouting{Reason: x.aff.reason, Session: x.aff.session, Pinned: x.aff.pinned,
		MaxAttempts: int32(min(len(cands), 1+h.retries))}
	for _, c := range cands {
		rt.Order = append(rt.Order, c.d.GetId())
	}
	tr.Routing = rt
	if rt.Reason == reasonShuffle && len(cands) > 1 {
		tr.Notes = append(tr.Notes, "the order is one weighted random draw: each request draws anew (send a session id for a stable choice)")
	}
	tr.Outcome = &configv1.ExplainOutcome{Status: http.StatusOK}
	return tr, nil
}

// explainAuth authenticates q's credential as the proxy would; a hard
// error (err) is a malformed query.
func (h *Handler) explainAuth(ctx context.Context, cat *catalog.Catalog, proto *protocol, q *configv1.ExplainQuery, hd http.Header,
	out *configv1.ExplainAuth) (*catalog.Principal, *openai.Error, error) {
	n := 0
	for _, set := range []bool{q.GetKeyId() != "", q.GetToken() != "", q.GetJwt() != nil} {
		if set {
			n++
		}
	}
	if n != 1 {
		return nil, nil, fmt.Errorf("%w: exactly one of key_id, token and jwt is required", ErrExplainInvalid)
	}
	switch {
	case q.GetToken() != "":
		out.Method = "virtual_key"
		if strings.Count(q.GetToken(), ".") == 2 {
			out.Method = "jwt"
		}
		r, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://explain"+q.GetRoute(), http.NoBody)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: %w", ErrExplainInvalid, err)
		}
		r.Header = hd.Clone()
		r.Header.Set("Authorization", "Bearer "+q.GetToken())
		p, e := proto.authenticate(h, cat, r)
		return p, e, nil
	case q.GetKeyId() != "":
		out.Method = "key_id"
		p, err := cat.KeyPrincipal(q.GetKeyId(), time.Now())
		var blocked *authn.BlockedError
		switch {
		case err == nil:
			return p, nil, nil
		case errors.As(err, &blocked):
			return p, openai.Forbidden(openai.BlockedCode(blocked.Scope), "", "access denied: the "+blocked.Scope+" of this key is blocked"), nil
		case errors.Is(err, authn.ErrExpired):
			return p, openai.Unauthorized(openai.CodeKeyExpired, "this API key has expired"), nil
		}
		return nil, nil, ErrExplainNotFound
	}
	out.Method = "jwt_claims"
	j := q.GetJwt()
	var aud []string
	if j.GetAudience() != "" {
		aud = []string{j.GetAudience()}
	}
	ti := cat.TrustedIssuer(j.GetIssuer(), aud)
	if ti == nil {
		return nil, nil, ErrExplainNotFound
	}
	claims := j.GetClaims().AsMap()
	p, e := authn.ClaimsPrincipal(cat, ti, j.GetSubject(), claims)
	if p == nil && e != nil {
		// The issuer is known: its org may see why its claims map to no one.
		p = &catalog.Principal{Key: &configv1.Key{Id: "jwt:" + ti.GetId(), OrgId: ti.GetOrgId()}}
		return p, e, nil
	}
	return p, e, nil
}

// explainBody is q's body: the given one, or one of the route's format
// built from the shape.
func explainBody(route string, q *configv1.ExplainQuery) ([]byte, error) {
	shape := q.GetModel() != "" || q.GetStream() || q.GetMaxTokens() != 0 || q.GetN() != 0 || q.GetTools() || q.GetPromptBytes() != 0
	if len(q.GetBody()) > 0 {
		if shape {
			return nil, fmt.Errorf("%w: body and the shape fields (model, stream, max_tokens, n, tools, prompt_bytes) are exclusive", ErrExplainInvalid)
		}
		return q.GetBody(), nil
	}
	if q.GetMaxTokens() < 0 || q.GetN() < 0 || q.GetPromptBytes() < 0 {
		return nil, fmt.Errorf("%w: max_tokens, n and prompt_bytes must not be negative", ErrExplainInvalid)
	}
	prompt := strings.Repeat("x", int(q.GetPromptBytes())) // at most MaxBodyBytes (Explain)
	b := map[string]any{"model": q.GetModel()}
	if q.GetStream() {
		b["stream"] = true
	}
	if q.GetN() > 0 {
		b["n"] = q.GetN()
	}
	fn := map[string]any{"name": "explain_tool", "parameters": map[string]any{"type": "object"}}
	switch route {
	case RouteCompletions:
		b["prompt"] = prompt
	case RouteEmbeddings:
		b["input"] = prompt
	case RouteResponses:
		b["input"] = prompt
		if q.GetTools() {
			b["tools"] = []any{map[string]any{"type": "function", "name": "explain_tool", "parameters": map[string]any{"type": "object"}}}
		}
	case RouteMessages:
		b["messages"] = []any{map[string]any{"role": "user", "content": prompt}}
		if q.GetTools() {
			b["tools"] = []any{map[string]any{"name": "explain_tool", "input_schema": map[string]any{"type": "object"}}}
		}
	default:
		b["messages"] = []any{map[string]any{"role": "user", "content": prompt}}
		if q.GetTools() {
			b["tools"] = []any{map[string]any{"type": "function", "function": fn}}
		}
	}
	if q.GetMaxTokens() > 0 {
		switch route {
		case RouteEmbeddings:
		case RouteResponses:
			b["max_output_tokens"] = q.GetMaxTokens()
		default:
			b["max_tokens"] = q.GetMaxTokens()
		}
	}
	return json.Marshal(b)
}

// explainClass classifies like exchange.classify, reading the key's
// interactive requests in flight instead of counting this one.
func (x *exchange) explainClass(cat *catalog.Catalog, hd http.Header) *configv1.ExplainClass {
	var pol *classify.Policy
	note := ""
	if tp := cat.TrafficPolicy(x.p.Key.GetOrgId()); tp != nil {
		pol = tp.Policy
		if tp.Err != nil {
			note = "; the org's classification rules do not compile and are not applied"
		}
	}
	in := classify.Input{KeyClass: x.p.Key.GetTrafficClass(), TeamClass: x.p.Team.GetTrafficClass(), Header: hd, PromptTokens: x.req.PromptEstimate()}
	if pol.Demotes() {
		in.InteractiveInFlight = x.h.inFlight.Peek(x.p.Key.GetId())
	}
	res := pol.Classify(in)
	x.classEnum, x.class, x.classReason = res.Class, classify.Name(res.Class), res.Reason
	var detail string
	switch r := res.Reason; {
	case r == classify.ReasonCredential && in.KeyClass != configv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED:
		detail = "the key's traffic_class"
	case r == classify.ReasonCredential:
		detail = "the team's traffic_class (the key names none)"
	case r == classify.ReasonDefault:
		detail = "the org's default class (no credential class, no rule matched)"
	case strings.HasPrefix(r, classify.ReasonRulePrefix):
		detail = "the org's classification rule rules[" + strings.TrimPrefix(r, classify.ReasonRulePrefix) + "] matched the request's headers"
	case r == classify.ReasonDemotedPrefix+classify.DemotedPromptTokens:
		detail = fmt.Sprintf("demoted from interactive: the prompt (about %d tokens) exceeds the org's max_prompt_tokens", in.PromptTokens)
	case r == classify.ReasonDemotedPrefix+classify.DemotedInFlight:
		detail = fmt.Sprintf("demoted from interactive: the key has %d interactive requests in flight on this data plane", in.InteractiveInFlight)
	}
	return &configv1.ExplainClass{Class: x.class, Reason: res.Reason, Detail: detail + note}
}

// explainLimits fills the trace's scopes with their headroom (read, never
// written) and returns the refusal admission would give, if any.
func (x *exchange) explainLimits(ctx context.Context, tr *configv1.ExplainTrace, cands []candidate) *openai.Error {
	h := x.h
	scopes := limitScopes(x.p, x.cust, x.labels, x.group, h.cfg.RateFallbackDefault)
	var depScopes []limits.Scope
	var depOrgs []string
	for _, c := range cands {
		if ss, ok := x.deploymentScopes(c.d); ok {
			for _, s := range ss {
				if s.MaxParallel == 0 && s.RPM == 0 && s.TPM == 0 {
					continue
				}
				depScopes = append(depScopes, s)
				depOrgs = append(depOrgs, limits.DeploymentOrg(c.d.GetId()))
			}
		}
	}
	if len(scopes) == 0 && len(depScopes) == 0 {
		return nil
	}
	est, maxCost, e := x.estimate(cands)
	if len(scopes) > 0 && e != nil {
		return e
	}
	x.estTokens, tr.EstimatedTokens, tr.MaxCostUsd = est, est, float64(maxCost)/1e6
	if h.cfg.Limiter == nil {
		if len(scopes) > 0 {
			return limitsUnavailable("this proxy runs without its limits store, and this key carries limits")
		}
		return nil
	}
	add := func(s limits.Scope, hr *limits.Headroom) *configv1.ExplainScope {
		es := &configv1.ExplainScope{Kind: s.Kind, Id: s.ID, RpmLimit: s.RPM, TpmLimit: s.TPM, ParallelLimit: s.MaxParallel}
		if s.Budget != nil {
			es.BudgetCapUsd, es.BudgetWindow = float64(s.Budget.CapMicros)/1e6, s.Budget.Window
		}
		if hr == nil {
			es.Unknown = true
		} else {
			es.RpmUsed, es.TpmUsed, es.ParallelInUse = hr.Requests, hr.Tokens, hr.Leases
			if s.Budget != nil {
				es.BudgetState, es.BudgetSpendUsd = hr.BudgetState, float64(hr.SpendMicros)/1e6
			}
		}
		tr.Scopes = append(tr.Scopes, es)
		return es
	}
	var refusal *openai.Error
	hrs, err := h.cfg.Limiter.Peek(ctx, x.p.Key.GetOrgId(), scopes)
	if err != nil {
		tr.Notes = append(tr.Notes, "the limits store did not answer: headroom unknown")
		if len(scopes) > 0 && (h.cfg.RateFallback == nil || !localFallbackAllowed(scopes)) {
			refusal = limitsUnavailable("the limits store did not answer in time; requests with limits are refused until it does")
		}
	}
	for i, s := range scopes {
		var hr *limits.Headroom
		if err == nil {
			hr = &hrs[i]
		}
		es := add(s, hr)
		if hr == nil || refusal != nil {
			continue
		}
		// The order of admit.lua: rpm, tpm, parallel, budget.
		scope := s.Kind + " " + s.ID
		switch {
		case s.RPM > 0 && hr.Requests+1 > s.RPM:
			es.WouldExceed = string(limits.LimitRPM)
			refusal = &openai.Error{Status: http.StatusTooManyRequests, Type: openai.TypeRateLimit, Code: openai.CodeRateLimitExceeded,
				Message: "rate limit exceeded: requests per minute (rpm) of " + scope}
		case s.TPM > 0 && hr.Tokens+est > s.TPM:
			es.WouldExceed = string(limits.LimitTPM)
			refusal = &openai.Error{Status: http.StatusTooManyRequests, Type: openai.TypeRateLimit, Code: openai.CodeTokenRateLimitExceeded,
				Message: fmt.Sprintf("rate limit exceeded: tokens per minute (tpm) of %s (this request is estimated at %d tokens)", scope, est)}
		case s.MaxParallel > 0 && hr.Leases >= s.MaxParallel:
			es.WouldExceed = string(limits.LimitParallel)
			refusal = &openai.Error{Status: http.StatusTooManyRequests, Type: openai.TypeRateLimit, Code: openai.CodeConcurrencyLimitExceeded,
				Message: "concurrency limit exceeded: max_parallel_requests of " + scope + " are in flight"}
		case s.Budget != nil && s.Budget.CapMicros > 0 && hr.BudgetState == limits.BudgetCurrent && hr.SpendMicros >= s.Budget.CapMicros:
			es.WouldExceed = string(limits.LimitBudget)
			refusal = &openai.Error{Status: http.StatusTooManyRequests, Type: openai.TypeBudgetExceeded, Code: openai.CodeBudgetExceeded,
				Message: fmt.Sprintf("budget exceeded for %s: spend $%s ≥ cap $%s in the current window", scope, usd(hr.SpendMicros), usd(s.Budget.CapMicros))}
		}
	}
	for i, s := range depScopes {
		var hr *limits.Headroom
		if v, perr := h.cfg.Limiter.Peek(ctx, depOrgs[i], []limits.Scope{s}); perr == nil {
			hr = &v[0]
		}
		if es := add(s, hr); hr != nil && s.MaxParallel > 0 && hr.Leases >= s.MaxParallel {
			es.WouldExceed = string(limits.LimitParallel)
			tr.Notes = append(tr.Notes, "deployment scope "+s.Kind+" "+s.ID+" is full: the request would wait in the admission queue or try another candidate")
		}
	}
	return refusal
}

// explainPrefill fills the candidates' prefill rows: the fleet-wide
// prefill tokens in flight of each one with max_concurrency (read from its
// max_concurrency scope, as admitDeployment's admission counts them), the
// prefill cap, this request's estimate, and whether the cap would make
// admission skip the candidate (limits.Prefill: a cap binds when the scope
// has prefill in flight and the request's estimate does not fit beside it).
func (x *exchange) explainPrefill(ctx context.Context, tr *configv1.ExplainTrace, rows map[string]*configv1.ExplainDeployment, cands []candidate) {
	for _, c := range cands {
		row := rows[c.d.GetId()]
		if row == nil { // a fallback group's deployment: not in the table
			continue
		}
		row.MaxPrefillTokensInFlight = c.d.GetTraffic().GetMaxPrefillTokensInFlight()
		if c.d.GetMaxConcurrency() <= 0 || x.h.cfg.Limiter == nil {
			continue // no fleet-wide count: the engine takes no lease
		}
		hr, err := x.h.cfg.Limiter.Peek(ctx, limits.DeploymentOrg(c.d.GetId()),
			[]limits.Scope{{Kind: limits.KindDeployment, ID: c.d.GetId(), MaxParallel: c.d.GetMaxConcurrency()}})
		if err != nil {
			continue
		}
		pt, est := hr[0].Prefill, x.prefillEstimate(c.d)
		row.PrefillTokensInFlight, row.PrefillEstimate = &pt, est
		if capTokens := prefillCap(c.d, x.classEnum); capTokens > 0 && pt > 0 && pt+est > capTokens {
			row.PrefillCapped = true
			tr.Notes = append(tr.Notes, fmt.Sprintf("deployment %s is skipped for its prefill cap: %d prefill tokens in flight + this request's %d > max_prefill_tokens_in_flight %d (the request tries another candidate or waits in the admission queue)",
				c.d.GetId(), pt, est, capTokens))
		}
	}
}

// minus returns the deployments of a not in b.
func minus(a, b []*catalog.Deployment) []*catalog.Deployment {
	var out []*catalog.Deployment
	for _, d := range a {
		if !slices.ContainsFunc(b, func(o *catalog.Deployment) bool { return o.GetId() == d.GetId() }) {
			out = append(out, d)
		}
	}
	return out
}
