package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/internal/budget"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// Limits (SPEC §8, issue 5; docs/limits.md). Every limit field of every
// level a request touches becomes a limits.Scope; one Admit call checks
// and consumes all of them before forwarding; one Settle (off the request
// path, exactly once) reconciles them with the real usage on every exit
// path. A deployment's max_concurrency is a fleet-wide lease taken per
// upstream attempt (a second call, only for deployments that set it).

// DefaultMaxOutputTokens bounds the output of a request that sets no
// max_tokens on a deployment that declares no max_output_tokens, for the
// token estimate and the cost reservation.
const DefaultMaxOutputTokens = 4096

// AlertSink receives budget alerts (published on NATS by the data plane).
// Alert must not block for long.
type AlertSink interface {
	Alert(a *usagev1.BudgetAlert)
}

// errLeaseLost cancels a request whose leases could not be renewed for a
// whole lease TTL: its slots may have been given away, so it must stop.
var errLeaseLost = errors.New("concurrency leases could not be renewed (limits unavailable)")

// limitScopes builds the scopes of a request: every level of the principal
// that carries a limit, the key's and team's per-model limits for group,
// the end customer's limits, and the project and tag scopes of the key
// (labels, catalog.LabelScopes). Scopes without any limit are left out.
func limitScopes(p *catalog.Principal, cu *configv1.Customer, labels []*configv1.LabelScope, group string, fallbackDefault bool) []limits.Scope {
	var out []limits.Scope
	// The budgets of the scopes (a scope points into it; a reallocation
	// leaves the earlier ones where they are). The first four scopes and
	// budgets are allocated together.
	var buds []limits.Budget
	var local bool // the rate_limit_fallback of the level being added
	add := func(kind, id string, rpm, tpm, par int64, capUSD, softUSD float64, window string) {
		s := limits.Scope{Kind: kind, ID: id, RPM: rpm, TPM: tpm, MaxParallel: par, LocalFallback: local}
		hasBudget := (capUSD > 0 || softUSD > 0) && window != ""
		if !hasBudget && s.RPM <= 0 && s.TPM <= 0 && s.MaxParallel <= 0 {
			return
		}
		if out == nil {
			a := new(scopeArena)
			out, buds = a.scopes[:0], a.budgets[:0]
		}
		if hasBudget {
			// The team its alerts are filed under, as alert names it for
			// a request's alerts.
			team := ""
			switch kind {
			case limits.KindKey, limits.KindKeyModel:
				team = p.Key.GetTeamId()
			case limits.KindMember, limits.KindTeam, limits.KindTeamModel:
				team = p.Team.GetId()
			}
			buds = append(buds, limits.Budget{CapMicros: budget.Micros(capUSD), SoftMicros: budget.Micros(softUSD), Window: window, Team: team})
			s.Budget = &buds[len(buds)-1]
		}
		out = append(out, s)
	}
	fallback := func(l *configv1.Limits) bool {
		switch l.GetRateLimitFallback() {
		case "local":
			return true
		case "closed":
			return false
		}
		return fallbackDefault
	}
	level := func(kind, id string, l *configv1.Limits, capUSD float64) {
		if l == nil && capUSD == 0 {
			return
		}
		local = fallback(l)
		if l.MaxBudget != nil {
			capUSD = l.GetMaxBudget()
		}
		add(kind, id, l.GetRpmLimit(), l.GetTpmLimit(), l.GetMaxParallelRequests(), capUSD, l.GetSoftBudget(), l.GetBudgetDuration())
	}
	perModel := func(kind, owner string, l *configv1.Limits) {
		if l == nil || group == "" {
			return
		}
		local = fallback(l)
		add(kind, budget.ModelID(owner, group), l.GetModelRpmLimit()[group], l.GetModelTpmLimit()[group], 0,
			l.GetModelMaxBudget()[group], 0, l.GetBudgetDuration())
	}
	k := p.Key
	level(limits.KindKey, k.GetId(), k.GetLimits(), 0)
	perModel(limits.KindKeyModel, k.GetId(), k.GetLimits())
	if p.User != nil {
		level(limits.KindUser, p.User.GetId(), p.User.GetLimits(), 0)
	}
	if m := p.Member; m != nil {
		level(limits.KindMember, budget.MemberID(m.GetTeamId(), m.GetUserId()), m.GetLimits(), m.GetMaxBudgetInTeam())
	}
	if p.Team != nil {
		level(limits.KindTeam, p.Team.GetId(), p.Team.GetLimits(), 0)
		perModel(limits.KindTeamModel, p.Team.GetId(), p.Team.GetLimits())
	}
	level(limits.KindOrg, p.Org.GetId(), p.Org.GetLimits(), 0)
	if cu != nil {
		level(limits.KindCustomer, cu.GetId(), cu.GetLimits(), 0)
	}
	for _, ls := range labels {
		kind := limits.KindProject
		if ls.GetKind() == catalog.LabelTag {
			kind = limits.KindTag
		}
		level(kind, ls.GetId(), ls.GetLimits(), 0)
	}
	return out
}

// scopeCache holds the scopes limitScopes built for the requests of one
// catalog (issue 15: built once per scope and snapshot, not per request).
// The scopes depend only on catalog objects, which a snapshot never
// changes, and the data plane's default fallback; a new catalog starts a
// new cache. The cached slices are shared by concurrent requests: neither
// the gateway nor the limiter writes into a Request's scopes (the limiter
// copies what it keeps).
type scopeCache struct {
	cat *catalog.Catalog
	m   sync.Map // scopeCacheKey → *cachedScopes
	n   atomic.Int64
}

// maxCachedScopeSets bounds the entries of one catalog's cache; past it,
// requests build their scopes as before.
const maxCachedScopeSets = 1 << 16

// scopeCacheKey is what a request's scopes are a function of (with the
// catalog: its label scopes follow from the key).
type scopeCacheKey struct {
	key    *configv1.Key
	user   *configv1.User
	member *configv1.Member
	team   *configv1.Team
	org    *configv1.Org
	cust   *configv1.Customer
	group  string
}

// scopes returns the request's limit scopes (limitScopes), from the
// handler's cache for the request's catalog. A JWT's principal carries a
// key of its own per request: its scopes are built each time.
func (x *exchange) scopes() []limits.Scope {
	h, p := x.h, x.p
	if x.cat == nil || strings.HasPrefix(p.Key.GetId(), "jwt:") {
		return limitScopes(p, x.cust, x.labels, x.group, h.cfg.RateFallbackDefault)
	}
	c := h.scopes.Load()
	if c == nil || c.cat != x.cat {
		nc := &scopeCache{cat: x.cat}
		if h.scopes.CompareAndSwap(c, nc) {
			c = nc
		} else if c = h.scopes.Load(); c.cat != x.cat {
			// Another catalog won the race (a request of an older or a
			// newer snapshot): no caching for this one.
			return limitScopes(p, x.cust, x.labels, x.group, h.cfg.RateFallbackDefault)
		}
	}
	k := scopeCacheKey{key: p.Key, user: p.User, member: p.Member, team: p.Team, org: p.Org, cust: x.cust, group: x.group}
	if v, ok := c.m.Load(k); ok {
		cs := v.(*cachedScopes)
		x.scopesChecked = cs.checked
		return cs.scopes
	}
	scopes := limitScopes(p, x.cust, x.labels, x.group, h.cfg.RateFallbackDefault)
	if c.n.Load() < maxCachedScopeSets {
		// Checked once for all the requests that share them: the limiter
		// does not check them again (limits.Request.ScopesChecked), and
		// finds their quota slices through them (limits.PrepareScopes).
		cs := &cachedScopes{scopes: scopes, checked: limits.PrepareScopes(scopes) == nil}
		if _, loaded := c.m.LoadOrStore(k, cs); !loaded {
			c.n.Add(1)
		}
	}
	return scopes
}

// cachedScopes is a scopeCache entry: a request's scopes, and whether
// limits.PrepareScopes accepted them.
type cachedScopes struct {
	scopes  []limits.Scope
	checked bool
}

// scopeArena is where limitScopes puts a request's first scopes and
// budgets: one allocation for the usual key, team and org levels.
type scopeArena struct {
	scopes  [4]limits.Scope
	budgets [4]limits.Budget
}

// estimate returns the admission token estimate and the maximum cost
// (micro-USD) of the request over its candidate deployments (docs/limits.md,
// "Estimator"): prompt ≈ ⌈4/3 × promptEstimate⌉ + 16 (promptEstimate counts
// about 4 bytes per token, so this assumes 3), output = choices (prompts ×
// max(n, best_of)) × the output cap: max_tokens, else the largest
// max_output_tokens of the candidates, else DefaultMaxOutputTokens (any
// candidate without one); embeddings have no output. Prices are the highest
// of the candidates. An estimate above MaxEstimateTokens or a maximum cost
// above MaxReservationMicros is refused (400 estimate_too_large): the
// arithmetic is checked, never wrapped.
func (x *exchange) estimate(cands []candidate) (tokens, maxCostMicros int64, e *openai.Error) {
	r := x.req
	prompt := (r.PromptEstimate()*4+2)/3 + 16 // promptEstimate ≤ the body's size: no overflow
	var inPrice, outPrice float64
	var capOut int64
	unbounded := false
	for _, c := range cands {
		pr := c.d.GetPrices()
		inPrice = max(inPrice, pr.GetInputPerToken())
		outPrice = max(outPrice, pr.GetOutputPerToken())
		if m := c.d.GetCapabilities().GetMaxOutputTokens(); m > 0 {
			capOut = max(capOut, m)
		} else {
			unbounded = true
		}
	}
	per := capOut
	switch {
	case x.route == RouteEmbeddings:
		per = 0
	case r.MaxTokens() > 0:
		per = r.MaxTokens()
	case unbounded:
		per = max(per, x.h.defaultMaxOut)
	}
	// The parameter a client changes to shrink the output.
	outParam := r.ChoicesParam()
	if outParam == "" {
		outParam = r.MaxTokensParam()
		if outParam == "" {
			outParam = "max_tokens"
		}
	}
	choices := r.OutputChoices()
	out, ok := openai.MulBounded(choices, per, openai.MaxEstimateTokens)
	if !ok {
		return 0, 0, openai.EstimateTooLarge(outParam,
			"%d sequences of up to %d output tokens each exceed the %d tokens Sluice accounts for one request; lower %s",
			choices, per, openai.MaxEstimateTokens, outParam)
	}
	if tokens = prompt + out; tokens > openai.MaxEstimateTokens {
		return 0, 0, openai.EstimateTooLarge(openai.PromptParam(x.route),
			"the request's token estimate exceeds the %d tokens Sluice accounts for one request", openai.MaxEstimateTokens)
	}
	costUSD := float64(prompt)*inPrice + float64(out)*outPrice
	if !(costUSD*1e6 <= float64(openai.MaxReservationMicros)) { // NaN too
		param := outParam
		if out == 0 || float64(prompt)*inPrice > float64(out)*outPrice {
			param = openai.PromptParam(x.route)
		}
		return 0, 0, openai.EstimateTooLarge(param,
			"the request's maximum cost at this model's prices exceeds the $%d Sluice reserves for one request; lower %s",
			openai.MaxReservationMicros/1_000_000, param)
	}
	return tokens, budget.Micros(costUSD), nil
}

// admit runs the one admission call for the request's scopes. A nil error
// admits (possibly with no limits at all); rate headers are set on w either
// way.
func (x *exchange) admit(ctx context.Context, w http.ResponseWriter, cands []candidate) *openai.Error {
	h := x.h
	scopes := x.scopes()
	if len(scopes) == 0 {
		return nil
	}
	est, maxCost, e := x.estimate(cands)
	if e != nil {
		return e
	}
	req := limits.Request{OrgID: x.p.Key.GetOrgId(), RequestID: x.id, Scopes: scopes, EstTokens: est, MaxCostMicros: maxCost,
		ScopesChecked: x.scopesChecked}
	x.estTokens = est
	if h.cfg.Limiter == nil {
		h.m.limitsUnavailable.WithLabelValues("admit").Inc()
		return limitsUnavailable("this proxy runs without its limits store, and this key carries limits")
	}
	for _, s := range scopes {
		if s.Budget != nil || s.TPM > 0 || s.MaxParallel > 0 {
			// Something to settle: admitted sweepable (lease.go).
			setHighestPrices(&x.lostPricesV, cands)
			x.lostPrices = &x.lostPricesV
			// The admission is the first report (its bound kicks a
			// renewal, the stream's rate is measured from it); the
			// report itself is built only if the limiter sends it.
			x.reportUsage(time.Now())
			req.Reporter = (*admissionReporter)(x)
			break
		}
	}
	d, err := h.cfg.Limiter.Admit(ctx, req)
	if err != nil {
		if !errors.Is(err, limits.ErrUnavailable) {
			h.log.Error("limits admission failed", "request_id", x.id, "error", err)
			return &openai.Error{Status: http.StatusInternalServerError, Type: openai.TypeServiceUnavailable, Code: openai.CodeInternal,
				Message: "the request's limits could not be evaluated (request id " + x.id + ")"}
		}
		h.m.limitsUnavailable.WithLabelValues("admit").Inc()
		h.cancelAdmission(d.Lease, err)
		if h.cfg.RateFallback == nil || !localFallbackAllowed(scopes) {
			return limitsUnavailable("the limits store did not answer in time; requests with limits are refused until it does")
		}
		d, err = h.cfg.RateFallback.Admit(req)
		switch {
		case errors.Is(err, limits.ErrNoFallback):
			h.m.limitsFallback.WithLabelValues("refused").Inc()
			return limitsUnavailable("the limits store did not answer in time; budget and concurrency limits never fall back, so this request is refused")
		case err != nil:
			return limitsUnavailable("the limits store did not answer in time")
		}
		if d.Allowed {
			h.m.limitsFallback.WithLabelValues("admitted").Inc()
			lr := req // a copy: req itself stays off the heap
			x.localReq = &lr
		} else {
			h.m.limitsFallback.WithLabelValues("rejected").Inc()
		}
	}
	setRateHeaders(w.Header(), d.Headers, h.cfg.IETFRateLimitHeaders)
	if !d.Allowed {
		return x.rejection(w, d.Rejection)
	}
	if d.Lease != nil && d.Lease.Needs() {
		x.lease = d.Lease
	}
	return nil
}

// localFallbackAllowed reports whether every rpm/tpm-limited scope allows
// the local fallback (rate_limit_fallback, else the data plane's default).
func localFallbackAllowed(scopes []limits.Scope) bool {
	for _, s := range scopes {
		if (s.RPM > 0 || s.TPM > 0) && !s.LocalFallback {
			return false
		}
	}
	return true
}

func limitsUnavailable(msg string) *openai.Error {
	return openai.Unavailable(openai.CodeLimitsUnavailable, msg, time.Second)
}

// rejection maps a limits rejection to its answer.
func (x *exchange) rejection(w http.ResponseWriter, r *limits.Rejection) *openai.Error {
	h := x.h
	if r.Unseeded {
		return x.unseeded(w, r)
	}
	h.m.limitRejections.WithLabelValues(r.Scope.Kind, string(r.Limit)).Inc()
	hd := w.Header()
	hd.Set(openai.HeaderLimitScope, r.Scope.String())
	hd.Set(openai.HeaderLimitType, string(r.Limit))
	scope := r.Scope.Kind + " " + r.Scope.ID
	e := &openai.Error{Status: http.StatusTooManyRequests, Type: openai.TypeRateLimit, RetryAfter: max(r.RetryAfter, time.Millisecond)}
	switch r.Limit {
	case limits.LimitRPM:
		e.Code = openai.CodeRateLimitExceeded
		e.Message = fmt.Sprintf("rate limit exceeded: requests per minute (rpm) of %s", scope)
	case limits.LimitTPM:
		e.Code = openai.CodeTokenRateLimitExceeded
		e.Message = fmt.Sprintf("rate limit exceeded: tokens per minute (tpm) of %s (this request is estimated at %d tokens)", scope, x.estTokens)
		if r.Never {
			e.NoRetry = true
			e.Message = fmt.Sprintf("this request is estimated at %d tokens, more than the tokens per minute (tpm) limit of %s allows; lower max_tokens, n or the prompt", x.estTokens, scope)
		}
	case limits.LimitParallel:
		e.Code = openai.CodeConcurrencyLimitExceeded
		e.Message = fmt.Sprintf("concurrency limit exceeded: max_parallel_requests of %s are in flight", scope)
		if r.Quarantined {
			e.Status, e.Type, e.Code = http.StatusServiceUnavailable, openai.TypeServiceUnavailable, openai.CodeLimitsRecovering
			e.Message = fmt.Sprintf("the limits store restarted moments ago; concurrency of %s is re-counted, retry shortly", scope)
		}
	case limits.LimitBudget:
		e.Type, e.Code, e.NoRetry = openai.TypeBudgetExceeded, openai.CodeBudgetExceeded, true
		e.Message = fmt.Sprintf("budget exceeded for %s: spend $%s ≥ cap $%s in the current window (resets %s)",
			scope, usd(r.SpendMicros), usd(r.CapMicros), r.WindowEnd.Format(time.RFC3339))
	}
	return e
}

func usd(micros int64) string {
	return strconv.FormatFloat(float64(micros)/1e6, 'f', 6, 64)
}

// setRateHeaders writes the OpenAI x-ratelimit-* headers for the tightest
// scope of each kind and, with ietf (--ietf-rate-limit-headers), the IETF
// RateLimit / RateLimit-Policy fields (draft-ietf-httpapi-ratelimit-headers:
// "rpm" and "tpm" policies over a 60 s window). The values that depend only
// on the limits (a snapshot's settings) are built once per pair of limits
// (rateHeaderCache); only remaining and reset are formatted per request,
// all into one string (one allocation, and one for the value slices).
//
// The IETF fields are opt-in: the two more entries take an answer's header
// map (7 entries of its own) from 13 to 15, past the 14 a 16-slot table
// holds, so net/http's map of every limited answer grows once more and its
// copy at WriteHeader doubles (docs/limits.md, "Headers").
func setRateHeaders(hd http.Header, rh limits.RateHeaders, ietf bool) {
	if rh.LimitRequests <= 0 && rh.LimitTokens <= 0 {
		return
	}
	pc := rateHeaderValues(rh.LimitRequests, rh.LimitTokens)
	// buf holds the values in order: remaining and reset of requests, of
	// tokens (for the kinds limited), then the RateLimit field; end[i] is
	// where value i ends.
	var bb [192]byte
	buf := bb[:0]
	var end [5]int
	n := 0
	var remR, remT []byte
	if rh.LimitRequests > 0 {
		buf = strconv.AppendInt(buf, max(rh.RemainingRequests, 0), 10)
		remR = buf[:len(buf):len(buf)]
		end[n] = len(buf)
		n++
		buf = appendReset(buf, rh.ResetRequests)
		end[n] = len(buf)
		n++
	}
	if rh.LimitTokens > 0 {
		from := len(buf)
		buf = strconv.AppendInt(buf, max(rh.RemainingTokens, 0), 10)
		remT = buf[from:len(buf):len(buf)]
		end[n] = len(buf)
		n++
		buf = appendReset(buf, rh.ResetTokens)
		end[n] = len(buf)
		n++
	}
	if ietf && rh.LimitRequests > 0 {
		buf = append(buf, `"rpm";r=`...)
		buf = append(buf, remR...)
		buf = append(buf, ";t="...)
		buf = strconv.AppendInt(buf, ceilSecondsInt(rh.ResetRequests), 10)
	}
	if ietf && rh.LimitTokens > 0 {
		if rh.LimitRequests > 0 {
			buf = append(buf, ", "...)
		}
		buf = append(buf, `"tpm";r=`...)
		buf = append(buf, remT...)
		buf = append(buf, ";t="...)
		buf = strconv.AppendInt(buf, ceilSecondsInt(rh.ResetTokens), 10)
	}
	if ietf {
		end[n] = len(buf)
		n++
	}
	all := string(buf)
	vals := make([]string, n)
	from := 0
	for i := range n {
		vals[i] = all[from:end[i]]
		from = end[i]
	}
	// Each header gets its own one-element slice of vals (capacity 1: an
	// Add elsewhere reallocates rather than writing into the next value).
	v := func(i int) []string { return vals[i : i+1 : i+1] }
	i := 0
	if rh.LimitRequests > 0 {
		hd["X-Ratelimit-Limit-Requests"] = pc.limitR
		hd["X-Ratelimit-Remaining-Requests"] = v(i)
		hd["X-Ratelimit-Reset-Requests"] = v(i + 1)
		i += 2
	}
	if rh.LimitTokens > 0 {
		hd["X-Ratelimit-Limit-Tokens"] = pc.limitT
		hd["X-Ratelimit-Remaining-Tokens"] = v(i)
		hd["X-Ratelimit-Reset-Tokens"] = v(i + 1)
		i += 2
	}
	if ietf {
		hd["Ratelimit-Policy"] = pc.policy
		hd["Ratelimit"] = v(i)
	}
}

// rateHeaderSet is the limit-only header values of one pair of limits.
// The slices are shared by every response: http.Header.Set and Add
// replace or grow them, never write into them.
type rateHeaderSet struct {
	limitR, limitT, policy []string
}

// rateHeaderCache holds the header values of the pairs of limits seen,
// up to maxRateHeaderSets (then it starts over): limits change only with
// the configuration. Reads take no lock (a sync.Map read of a stable key).
var rateHeaderCache atomic.Pointer[rateHeaderSets]

type rateHeaderSets struct {
	m sync.Map // [2]int64 → *rateHeaderSet
	n atomic.Int64
}

const maxRateHeaderSets = 4096

func rateHeaderValues(rpm, tpm int64) *rateHeaderSet {
	k := [2]int64{rpm, tpm}
	c := rateHeaderCache.Load()
	if c != nil {
		if v, ok := c.m.Load(k); ok {
			return v.(*rateHeaderSet)
		}
	}
	v := &rateHeaderSet{}
	var policy []string
	if rpm > 0 {
		v.limitR = []string{strconv.FormatInt(rpm, 10)}
		policy = append(policy, `"rpm";q=`+v.limitR[0]+";w=60")
	}
	if tpm > 0 {
		v.limitT = []string{strconv.FormatInt(tpm, 10)}
		policy = append(policy, `"tpm";q=`+v.limitT[0]+";w=60")
	}
	v.policy = []string{strings.Join(policy, ", ")}
	if c == nil || c.n.Load() >= maxRateHeaderSets {
		nc := new(rateHeaderSets)
		if !rateHeaderCache.CompareAndSwap(c, nc) {
			return v // another request started over at the same moment
		}
		c = nc
	}
	if got, loaded := c.m.LoadOrStore(k, v); loaded {
		return got.(*rateHeaderSet)
	}
	c.n.Add(1)
	return v
}

// resetString formats a reset duration as OpenAI does ("1s", "6m0s", "20ms").
func resetString(d time.Duration) string { return string(appendReset(nil, d)) }

// appendReset appends resetString(d) to b: under a second in whole
// milliseconds (at least 1), else d rounded to the millisecond as
// time.Duration.String formats it ("1m0.276s", "1h0m5s").
func appendReset(b []byte, d time.Duration) []byte {
	if d <= 0 {
		return append(b, "0s"...)
	}
	if d < time.Second {
		b = strconv.AppendInt(b, max(d.Milliseconds(), 1), 10)
		return append(b, "ms"...)
	}
	ms := int64(d.Round(time.Millisecond) / time.Millisecond)
	h, m, sec, frac := ms/3_600_000, ms/60_000%60, ms/1000%60, ms%1000
	if h > 0 {
		b = strconv.AppendInt(b, h, 10)
		b = append(b, 'h')
	}
	if h > 0 || m > 0 {
		b = strconv.AppendInt(b, m, 10)
		b = append(b, 'm')
	}
	b = strconv.AppendInt(b, sec, 10)
	if frac > 0 {
		digits := [3]byte{byte('0' + frac/100), byte('0' + frac/10%10), byte('0' + frac%10)}
		k := 3
		for digits[k-1] == '0' {
			k--
		}
		b = append(b, '.')
		b = append(b, digits[:k]...)
	}
	return append(b, 's')
}

func ceilSecondsInt(d time.Duration) int64 { return int64((d + time.Second - 1) / time.Second) }

// admitDeployment takes a fleet-wide lease on a deployment that sets
// max_concurrency. ok is false when the deployment is at its cap; e is a
// fail-closed answer when Redis is unavailable.
func (x *exchange) admitDeployment(ctx context.Context, d *catalog.Deployment, prefill int64) (lease *limits.Lease, rej *limits.Rejection, e *openai.Error) {
	h := x.h
	if h.cfg.Limiter == nil || d.GetMaxConcurrency() <= 0 {
		return nil, nil, nil
	}
	scopes, ok := x.deploymentScopes(d) // max_concurrency and the class caps (traffic.go)
	if !ok {
		return nil, &limits.Rejection{Limit: limits.LimitParallel, RetryAfter: time.Second}, nil
	}
	dec, err := h.cfg.Limiter.Admit(ctx, limits.Request{
		OrgID: limits.DeploymentOrg(d.GetId()), RequestID: x.id + "/" + strconv.Itoa(x.attempts), Scopes: scopes,
		// Prefill in flight is accounted on the max_concurrency scope
		// (scopes[0]) for every class; the cap binds agent and batch.
		Prefill: &limits.Prefill{Scope: 0, Tokens: max(prefill, 0), Cap: prefillCap(d, x.classEnum)},
	})
	if err != nil {
		h.m.limitsUnavailable.WithLabelValues("admit").Inc()
		if errors.Is(err, limits.ErrUnavailable) {
			h.cancelAdmission(dec.Lease, err)
			return nil, nil, limitsUnavailable("the limits store did not answer in time; deployment concurrency cannot be checked")
		}
		h.log.Error("deployment admission failed", "request_id", x.id, "error", err)
		return nil, nil, limitsUnavailable("deployment concurrency cannot be checked")
	}
	h.sawPrefill(d.GetId(), dec.PrefillInFlight)
	if !dec.Allowed {
		h.m.limitRejections.WithLabelValues(limits.KindDeployment, string(dec.Rejection.Limit)).Inc()
		return nil, dec.Rejection, nil
	}
	return dec.Lease, nil, nil
}

// liveLeases are the leases an exchange holds: its admission and, during
// an attempt, the deployment's.
type liveLeases struct {
	mu   sync.Mutex
	main *limits.Lease
	dep  *limits.Lease
}

func (l *liveLeases) snapshot() []*limits.Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]*limits.Lease, 0, 2)
	for _, x := range []*limits.Lease{l.main, l.dep} {
		if x != nil {
			out = append(out, x)
		}
	}
	return out
}

func (l *liveLeases) setDep(d *limits.Lease) {
	l.mu.Lock()
	l.dep = d
	l.mu.Unlock()
}

// startRenewal renews the exchange's leases every RenewInterval until
// stopRenewal, on the handler's shared renewal tick (renewtick.go). When
// no renewal succeeds for LeaseTTL − RenewInterval the request is
// cancelled with errLeaseLost: its slots may have been given away, and a
// request must not outlive its lease.
func (x *exchange) startRenewal() {
	lim := x.h.cfg.Limiter
	if lim == nil || x.renewal != nil {
		return
	}
	r := &x.renewalV
	*r = renewal{x: x, lastOK: time.Now()}
	x.renewal = r
	x.h.renewals.add(r, lim)
}

// renewal is an exchange's place on the renewal tick: renewed every
// interval until stopped, and at once when kicked (a sweepable stream
// reporting its usage, lease.go). Renewals of one exchange never run
// concurrently: the tick renews one batch at a time, and a kick during a
// renewal runs another after it.
type renewal struct {
	x *exchange
	// Guarded by the tick's mutex: the schedule, and the links of the
	// tick's set (nil when not in it).
	due        time.Time
	kicked     bool
	stopped    bool
	prev, next *renewal
	// Only the tick's goroutine uses lastOK.
	lastOK time.Time
}

// kick renews now (or right after the renewal in progress).
func (r *renewal) kick() { r.x.h.renewals.kick(r) }

// renewed handles the outcome of one renewal of the exchange's leases
// (the admission's with the request's report), states[i] and errs[i] for
// leases[i], and reports false when it aborted the request.
func (r *renewal) renewed(leases []*limits.Lease, states []limits.RenewState, errs []error, interval, ttl time.Duration) bool {
	x := r.x
	ok := true
	for i := range leases {
		if errs[i] != nil {
			ok = false
			x.h.m.limitsUnavailable.WithLabelValues("renew").Inc()
			continue
		}
		switch states[i] {
		case limits.RenewReasserted:
			x.h.m.leasesReasserted.Inc()
		case limits.RenewSwept:
			// Renewals were late by a whole lease TTL and a sweeper
			// settled the request: its slots and reservation are gone.
			x.h.sm.foundSwept.WithLabelValues("renew").Inc()
			x.h.log.Warn("aborting request: a sweeper settled it after its leases expired", "request_id", x.id)
			x.abort(errLeaseLost)
			return false
		case limits.RenewLost:
			// A concurrency slot of a quota slice whose lease could not be
			// renewed in time: it may be given away.
			x.h.log.Warn("aborting request: its quota slice's slot could not be renewed", "request_id", x.id)
			x.abort(errLeaseLost)
			return false
		}
	}
	if !x.renewGate(context.Background()) {
		ok = false
	}
	if ok {
		r.lastOK = time.Now()
	} else if time.Since(r.lastOK) > ttl-interval {
		x.h.log.Warn("aborting request: leases could not be renewed", "request_id", x.id)
		x.abort(errLeaseLost)
		return false
	}
	return true
}

func (x *exchange) stopRenewal() {
	if r := x.renewal; r != nil {
		x.h.renewals.remove(r)
	}
}

// settleLeases settles the admission lease with the request's real usage
// and cost, off the request path; settling is idempotent by request id,
// so it is retried until Redis answers (bounded by settleGiveUp).
func (x *exchange) settleLeases(tokens int64, costUSD float64) {
	h := x.h
	if x.localReq != nil && h.cfg.RateFallback != nil {
		h.cfg.RateFallback.Reconcile(*x.localReq, tokens)
	}
	if x.lease == nil {
		return
	}
	if x.shed {
		// Shed without an attempt (no slot, queue full or timed out): the
		// admission consumes nothing, its rpm unit included.
		h.enqueueSettle(limits.SettleItem{Lease: x.lease, Cancel: true}, x.alertMeta(), nil)
		return
	}
	h.settleAsync(x.lease, tokens, budget.Micros(costUSD), x.alertMeta())
}

// alertMeta is what an alert needs from the exchange.
type alertMeta struct {
	requestID, orgID, keyTeam, teamID string
}

func (x *exchange) alertMeta() alertMeta {
	m := alertMeta{requestID: x.id, orgID: x.p.Key.GetOrgId(), keyTeam: x.p.Key.GetTeamId()}
	if x.p.Team != nil {
		m.teamID = x.p.Team.GetId()
	}
	return m
}

func (h *Handler) settleAsync(l *limits.Lease, tokens, costMicros int64, meta alertMeta) {
	h.enqueueSettle(limits.SettleItem{Lease: l, Tokens: tokens, CostMicros: costMicros}, meta, nil)
}

// enqueueSettle hands a settlement to the settlement worker
// (limits.Settler, run by Run); done, when set, runs once it is settled
// or given up. A request admitted entirely from quota slices that wrote
// nothing in Redis is settled here at once, in process (no call to wait
// for, so no worker to wake).
func (h *Handler) enqueueSettle(item limits.SettleItem, meta alertMeta, done func()) {
	if res, ok := h.cfg.Limiter.SettleLocal(item); ok {
		h.settled(res, meta)
		if done != nil {
			done()
		}
		return
	}
	h.m.pendingSettles.Inc()
	h.settler.Enqueue(limits.SettleJob{Item: item, Done: func(res limits.SettleResult, err error) {
		if err != nil {
			h.m.settleFailures.Inc()
			h.log.Error("giving up settling a request's limits", "request_id", item.Lease.RequestID(), "error", err)
		} else {
			h.settled(res, meta)
		}
		if done != nil {
			done()
		}
		h.m.pendingSettles.Dec()
	}})
}

// settled finishes a settlement: its alerts and metrics.
func (h *Handler) settled(res limits.SettleResult, meta alertMeta) {
	if res.WithoutRecord {
		h.m.settlesWithoutRecord.Inc()
	}
	if res.Swept {
		h.sm.foundSwept.WithLabelValues("settle").Inc()
	}
	for _, a := range res.Alerts {
		h.alert(a, meta)
	}
}

// maxPendingCancels bounds the settlements queued to cancel admissions
// that timed out (a long outage under heavy load must not pile up
// goroutines); past it a late admission heals by itself: leases by TTL,
// the rest with its window.
const maxPendingCancels = 10_000

// cancelAdmission settles, with zero usage, an admission whose call failed
// but may still run in Redis (a frozen server executes queued commands when
// it resumes): whichever comes first, the late admission consumes nothing
// for long. Settling is idempotent and leaves a tombstone the admission
// script refuses.
func (h *Handler) cancelAdmission(l *limits.Lease, err error) {
	if l == nil || !l.Needs() || !limits.MayHaveRun(err) {
		return
	}
	if h.pendingCancels.Add(1) > maxPendingCancels {
		h.pendingCancels.Add(-1)
		h.m.settleFailures.Inc()
		return
	}
	h.enqueueSettle(limits.SettleItem{Lease: l, Cancel: true}, alertMeta{}, func() { h.pendingCancels.Add(-1) })
}

// releaseDeploymentLease releases the deployment lease of the current
// attempt, if any (exactly once: the lease is taken out first).
func (x *exchange) releaseDeploymentLease() {
	x.leases.mu.Lock()
	l := x.leases.dep
	x.leases.dep = nil
	x.leases.mu.Unlock()
	if l != nil {
		// Waiters of the group, on this proxy and the fleet's others, try
		// again once the slot is free in the limits store.
		group := x.group
		x.h.enqueueSettle(limits.SettleItem{Lease: l}, alertMeta{}, func() { x.h.queues.Released(group) })
	}
}

// carveAlerts publishes the alerts the limiter's quota slices raise
// (limits.Limiter.OnCarveAlerts): no request carries them.
func (h *Handler) carveAlerts(as []limits.BudgetAlert) {
	for _, a := range as {
		h.alert(a, alertMeta{orgID: a.OrgID, keyTeam: a.TeamID, teamID: a.TeamID})
	}
}

// alert publishes a budget alert (NATS event via the AlertSink, metric,
// log line).
func (h *Handler) alert(a limits.BudgetAlert, meta alertMeta) {
	h.m.budgetAlerts.WithLabelValues(a.Scope.Kind, strconv.FormatInt(a.Percent, 10)).Inc()
	team := ""
	switch a.Scope.Kind {
	case limits.KindKey, limits.KindKeyModel:
		team = meta.keyTeam
	case limits.KindMember, limits.KindTeam, limits.KindTeamModel:
		team = meta.teamID
	}
	h.log.Warn("budget alert", "org_id", meta.orgID, "scope", a.Scope.String(), "threshold_percent", a.Percent,
		"spend_usd", usd(a.SpendMicros), "cap_usd", usd(a.CapMicros), "soft_usd", usd(a.SoftMicros))
	if h.cfg.Alerts == nil {
		return
	}
	now := time.Now()
	start, _, _ := budget.Window(a.Window, now)
	id := fmt.Sprintf("%s/%s/%s/%s/%d/%d", meta.orgID, a.Scope.Kind, a.Scope.ID, a.Window, start.Unix(), a.Percent)
	h.cfg.Alerts.Alert(&usagev1.BudgetAlert{
		AlertId: id, Time: timestamppb.New(now), OrgId: meta.orgID, TeamId: team,
		ScopeKind: a.Scope.Kind, ScopeId: a.Scope.ID, ThresholdPercent: int32(a.Percent),
		SpendMicros: a.SpendMicros, CapMicros: a.CapMicros, SoftMicros: a.SoftMicros,
		Window: a.Window, WindowStart: start.Unix(), Region: h.cfg.Region, InstanceId: h.cfg.InstanceID,
		RequestId: meta.requestID,
	})
}

// DrainSettlements waits until no settlement is pending or ctx ends (Run
// must be running); the quota slices stay held.
func (h *Handler) DrainSettlements(ctx context.Context) error {
	if h.settler == nil {
		return nil
	}
	return h.settler.Drain(ctx)
}

// Drain waits until no settlement is pending or ctx ends (Run must be
// running), then gives back the quota slices the limiter holds
// (limits.Limiter.ReturnSlices): a drained data plane expects no more
// requests, so its free slots, budget and rate units go back to the fleet
// at once instead of when the scopes linger.
func (h *Handler) Drain(ctx context.Context) error {
	if err := h.DrainSettlements(ctx); err != nil {
		return err
	}
	if h.cfg.Limiter == nil {
		return nil
	}
	return h.cfg.Limiter.ReturnSlices(ctx)
}
