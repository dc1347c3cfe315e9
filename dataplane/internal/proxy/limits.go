package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
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

// Error codes and types of limit rejections (docs/errors.md).
const (
	TypeRateLimit = "rate_limit_error"
	// TypeBudgetExceeded is the type of a budget rejection (SPEC §8.3).
	TypeBudgetExceeded = "budget_exceeded"

	CodeRateLimitExceeded        = "rate_limit_exceeded"
	CodeTokenRateLimitExceeded   = "token_rate_limit_exceeded"
	CodeConcurrencyLimitExceeded = "concurrency_limit_exceeded"
	CodeBudgetExceeded           = "budget_exceeded"
	// CodeLimitsUnavailable: Redis is unreachable or slower than the
	// per-call timeout; limits fail closed.
	CodeLimitsUnavailable = "limits_unavailable"
	// CodeLimitsRecovering: Redis lost its state moments ago; concurrency
	// limited scopes wait until live requests re-asserted their leases.
	CodeLimitsRecovering = "limits_recovering"
)

// Headers naming the scope and limit of a rejection.
const (
	HeaderLimitScope = "X-Sluice-Limit-Scope"
	HeaderLimitType  = "X-Sluice-Limit-Type"
)

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
// and the end customer's limits. Scopes without any limit are left out.
func limitScopes(cat *catalog.Catalog, p *catalog.Principal, cu *configv1.Customer, group string, fallbackDefault bool) []limits.Scope {
	var out []limits.Scope
	var local bool // the rate_limit_fallback of the level being added
	add := func(kind, id string, rpm, tpm, par int64, capUSD, softUSD float64, window string) {
		s := limits.Scope{Kind: kind, ID: id, RPM: rpm, TPM: tpm, MaxParallel: par, LocalFallback: local}
		if (capUSD > 0 || softUSD > 0) && window != "" {
			b := &limits.Budget{CapMicros: budget.Micros(capUSD), SoftMicros: budget.Micros(softUSD), Window: window}
			if seed, ok := cat.BudgetSeed(kind, id, window); ok {
				b.SeedMicros, b.SeedWindowStart = seed.SpendMicros, seed.WindowStart
			}
			s.Budget = b
		}
		if s.RPM > 0 || s.TPM > 0 || s.MaxParallel > 0 || s.Budget != nil {
			out = append(out, s)
		}
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
	return out
}

// estimate returns the admission token estimate and the maximum cost
// (micro-USD) of the request over its candidate deployments (docs/limits.md,
// "Estimator"): prompt ≈ ⌈4/3 × promptEstimate⌉ + 16 (promptEstimate counts
// about 4 bytes per token, so this assumes 3), output = max_tokens, else
// the largest max_output_tokens of the candidates, else
// DefaultMaxOutputTokens (any candidate without one); embeddings have no
// output. Prices are the highest of the candidates.
func (x *exchange) estimate(cands []candidate) (tokens, maxCostMicros int64) {
	prompt := (x.req.promptEstimate*4+2)/3 + 16
	var out, inPrice, outPrice float64
	unbounded := false
	for _, c := range cands {
		pr := c.d.GetPrices()
		inPrice = max(inPrice, pr.GetInputPerToken())
		outPrice = max(outPrice, pr.GetOutputPerToken())
		if m := c.d.GetCapabilities().GetMaxOutputTokens(); m > 0 {
			out = max(out, float64(m))
		} else {
			unbounded = true
		}
	}
	switch {
	case x.route == RouteEmbeddings:
		out = 0
	case x.req.maxTokens > 0:
		out = float64(x.req.maxTokens)
	case unbounded:
		out = max(out, float64(x.h.defaultMaxOut))
	}
	return prompt + int64(out), budget.Micros(float64(prompt)*inPrice + out*outPrice)
}

// admit runs the one admission call for the request's scopes. A nil error
// admits (possibly with no limits at all); rate headers are set on w either
// way.
func (x *exchange) admit(ctx context.Context, w http.ResponseWriter, cat *catalog.Catalog, cands []candidate) *Error {
	h := x.h
	scopes := limitScopes(cat, x.p, x.cust, x.group, h.cfg.RateFallbackDefault)
	if len(scopes) == 0 {
		return nil
	}
	est, maxCost := x.estimate(cands)
	req := limits.Request{OrgID: x.p.Key.GetOrgId(), RequestID: x.id, Scopes: scopes, EstTokens: est, MaxCostMicros: maxCost}
	x.estTokens = est
	if h.cfg.Limiter == nil {
		h.m.limitsUnavailable.WithLabelValues("admit").Inc()
		return limitsUnavailable("this proxy runs without its limits store, and this key carries limits")
	}
	d, err := h.cfg.Limiter.Admit(ctx, req)
	if err != nil {
		if !errors.Is(err, limits.ErrUnavailable) {
			h.log.Error("limits admission failed", "request_id", x.id, "error", err)
			return &Error{Status: http.StatusInternalServerError, Type: TypeServiceUnavailable, Code: "internal_error",
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
			x.localReq = &req
		} else {
			h.m.limitsFallback.WithLabelValues("rejected").Inc()
		}
	}
	setRateHeaders(w.Header(), d.Headers)
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

func limitsUnavailable(msg string) *Error {
	return unavailable(CodeLimitsUnavailable, msg, time.Second)
}

// rejection maps a limits rejection to its answer.
func (x *exchange) rejection(w http.ResponseWriter, r *limits.Rejection) *Error {
	h := x.h
	h.m.limitRejections.WithLabelValues(r.Scope.Kind, string(r.Limit)).Inc()
	hd := w.Header()
	hd.Set(HeaderLimitScope, r.Scope.String())
	hd.Set(HeaderLimitType, string(r.Limit))
	scope := r.Scope.Kind + " " + r.Scope.ID
	e := &Error{Status: http.StatusTooManyRequests, Type: TypeRateLimit, RetryAfter: max(r.RetryAfter, time.Millisecond)}
	switch r.Limit {
	case limits.LimitRPM:
		e.Code = CodeRateLimitExceeded
		e.Message = fmt.Sprintf("rate limit exceeded: requests per minute (rpm) of %s", scope)
	case limits.LimitTPM:
		e.Code = CodeTokenRateLimitExceeded
		e.Message = fmt.Sprintf("rate limit exceeded: tokens per minute (tpm) of %s (this request is estimated at %d tokens)", scope, x.estTokens)
		if r.Never {
			e.NoRetry = true
			e.Message = fmt.Sprintf("this request is estimated at %d tokens, more than the tokens per minute (tpm) limit of %s allows; lower max_tokens or the prompt", x.estTokens, scope)
		}
	case limits.LimitParallel:
		e.Code = CodeConcurrencyLimitExceeded
		e.Message = fmt.Sprintf("concurrency limit exceeded: max_parallel_requests of %s are in flight", scope)
		if r.Quarantined {
			e.Status, e.Type, e.Code = http.StatusServiceUnavailable, TypeServiceUnavailable, CodeLimitsRecovering
			e.Message = fmt.Sprintf("the limits store restarted moments ago; concurrency of %s is re-counted, retry shortly", scope)
		}
	case limits.LimitBudget:
		e.Type, e.Code, e.NoRetry = TypeBudgetExceeded, CodeBudgetExceeded, true
		e.Message = fmt.Sprintf("budget exceeded for %s: spend $%s ≥ cap $%s in the current window (resets %s)",
			scope, usd(r.SpendMicros), usd(r.CapMicros), r.WindowEnd.Format(time.RFC3339))
	}
	return e
}

func usd(micros int64) string {
	return strconv.FormatFloat(float64(micros)/1e6, 'f', 6, 64)
}

// setRateHeaders writes the OpenAI x-ratelimit-* headers for the tightest
// scope of each kind and the IETF RateLimit / RateLimit-Policy fields
// (draft-ietf-httpapi-ratelimit-headers: "rpm" and "tpm" policies over a
// 60 s window).
func setRateHeaders(hd http.Header, rh limits.RateHeaders) {
	var policy, state []string
	if rh.LimitRequests > 0 {
		hd.Set("X-Ratelimit-Limit-Requests", strconv.FormatInt(rh.LimitRequests, 10))
		hd.Set("X-Ratelimit-Remaining-Requests", strconv.FormatInt(max(rh.RemainingRequests, 0), 10))
		hd.Set("X-Ratelimit-Reset-Requests", resetString(rh.ResetRequests))
		policy = append(policy, `"rpm";q=`+strconv.FormatInt(rh.LimitRequests, 10)+";w=60")
		state = append(state, `"rpm";r=`+strconv.FormatInt(max(rh.RemainingRequests, 0), 10)+";t="+ceilSeconds(rh.ResetRequests))
	}
	if rh.LimitTokens > 0 {
		hd.Set("X-Ratelimit-Limit-Tokens", strconv.FormatInt(rh.LimitTokens, 10))
		hd.Set("X-Ratelimit-Remaining-Tokens", strconv.FormatInt(max(rh.RemainingTokens, 0), 10))
		hd.Set("X-Ratelimit-Reset-Tokens", resetString(rh.ResetTokens))
		policy = append(policy, `"tpm";q=`+strconv.FormatInt(rh.LimitTokens, 10)+";w=60")
		state = append(state, `"tpm";r=`+strconv.FormatInt(max(rh.RemainingTokens, 0), 10)+";t="+ceilSeconds(rh.ResetTokens))
	}
	if len(policy) > 0 {
		hd.Set("RateLimit-Policy", strings.Join(policy, ", "))
		hd.Set("RateLimit", strings.Join(state, ", "))
	}
}

// resetString formats a reset duration as OpenAI does ("1s", "6m0s", "20ms").
func resetString(d time.Duration) string {
	if d <= 0 {
		return "0s"
	}
	if d < time.Second {
		return strconv.FormatInt(max(d.Milliseconds(), 1), 10) + "ms"
	}
	return d.Round(time.Millisecond).String()
}

func ceilSeconds(d time.Duration) string {
	return strconv.FormatInt(int64((d+time.Second-1)/time.Second), 10)
}

// admitDeployment takes a fleet-wide lease on a deployment that sets
// max_concurrency. ok is false when the deployment is at its cap; e is a
// fail-closed answer when Redis is unavailable.
func (x *exchange) admitDeployment(ctx context.Context, d *catalog.Deployment) (lease *limits.Lease, rej *limits.Rejection, e *Error) {
	h := x.h
	if h.cfg.Limiter == nil || d.GetMaxConcurrency() <= 0 {
		return nil, nil, nil
	}
	dec, err := h.cfg.Limiter.Admit(ctx, limits.Request{
		OrgID: limits.DeploymentOrg(d.GetId()), RequestID: x.id + "/" + strconv.Itoa(x.attempts),
		Scopes: []limits.Scope{{Kind: limits.KindDeployment, ID: d.GetId(), MaxParallel: d.GetMaxConcurrency()}},
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
// stopRenewal. When no renewal succeeds for LeaseTTL − RenewInterval the
// request is cancelled with errLeaseLost: its slots may have been given
// away, and a request must not outlive its lease.
func (x *exchange) startRenewal() {
	lim := x.h.cfg.Limiter
	if lim == nil || x.renewal != nil {
		return
	}
	// A timer, not a goroutine: most requests end before the first
	// renewal is due and then cost nothing here.
	r := &renewal{x: x, lim: lim, interval: lim.RenewInterval(), ttl: lim.LeaseTTL(), lastOK: time.Now()}
	x.renewal = r
	r.mu.Lock()
	r.t = time.AfterFunc(r.interval, r.fire)
	r.mu.Unlock()
}

// renewal renews an exchange's leases every interval until stopped.
type renewal struct {
	x             *exchange
	lim           *limits.Limiter
	interval, ttl time.Duration
	lastOK        time.Time
	mu            sync.Mutex
	t             *time.Timer
	stopped       bool
}

func (r *renewal) fire() {
	x := r.x
	ok := true
	for _, l := range x.leases.snapshot() {
		st, err := r.lim.Renew(context.Background(), l)
		if err != nil {
			ok = false
			x.h.m.limitsUnavailable.WithLabelValues("renew").Inc()
			continue
		}
		if st == limits.RenewReasserted {
			x.h.m.leasesReasserted.Inc()
		}
	}
	if ok {
		r.lastOK = time.Now()
	} else if time.Since(r.lastOK) > r.ttl-r.interval {
		x.h.log.Warn("aborting request: leases could not be renewed", "request_id", x.id)
		x.abort(errLeaseLost)
		return
	}
	r.mu.Lock()
	if !r.stopped {
		r.t.Reset(r.interval)
	}
	r.mu.Unlock()
}

func (x *exchange) stopRenewal() {
	if r := x.renewal; r != nil {
		r.mu.Lock()
		r.stopped = true
		r.t.Stop()
		r.mu.Unlock()
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
	h.settleAsync(x.lease, tokens, budget.Micros(costUSD), x.alertMeta())
}

// settleGiveUp bounds the retries of one settlement. Past it the leases
// have expired anyway (LeaseTTL); the tpm and budget counters keep the
// admission's estimate and reservation (conservative), and the ledger is
// unaffected (it is written from usage events).
const settleGiveUp = 2 * time.Minute

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
	h.settleAsyncDone(l, tokens, costMicros, meta, nil)
}

func (h *Handler) settleAsyncDone(l *limits.Lease, tokens, costMicros int64, meta alertMeta, done func()) {
	h.enqueueSettle(settleJob{item: limits.SettleItem{Lease: l, Tokens: tokens, CostMicros: costMicros}, meta: meta, done: done})
}

// enqueueSettle hands j to the settlement worker.
func (h *Handler) enqueueSettle(j settleJob) {
	h.pending.Add(1)
	h.m.pendingSettles.Inc()
	select {
	case h.settleQ <- j:
		if h.settling.CompareAndSwap(false, true) {
			go h.settleWorker()
		}
	default:
		go h.settleRetry(j, nil)
	}
}

// settleJob is one queued settlement.
type settleJob struct {
	item limits.SettleItem
	meta alertMeta
	done func()
}

// Settlements are queued and settled by one worker in batches (one round
// trip, and one script call per org, for many requests; the worker exits
// when the queue is empty). A failed one is retried on its own with
// backoff.
const (
	settleQueueLen = 8192
	maxSettleBatch = 64
)

func (h *Handler) settleWorker() {
	batch := make([]settleJob, 0, maxSettleBatch)
	items := make([]limits.SettleItem, 0, maxSettleBatch)
	for {
		batch, items = batch[:0], items[:0]
		// Let the goroutines that are ready run first: requests finishing
		// now queue their settlements into this batch (one script call per
		// org settles them together).
		runtime.Gosched()
	collect:
		for len(batch) < maxSettleBatch {
			select {
			case j := <-h.settleQ:
				batch = append(batch, j)
				items = append(items, j.item)
			default:
				break collect
			}
		}
		if len(batch) == 0 {
			h.settling.Store(false)
			// A job queued after the last receive and before the flag
			// was cleared found the worker running: take it over.
			if len(h.settleQ) > 0 && h.settling.CompareAndSwap(false, true) {
				continue
			}
			return
		}
		res, errs := h.cfg.Limiter.SettleBatch(context.Background(), items)
		for i, j := range batch {
			if errs[i] != nil {
				h.m.limitsUnavailable.WithLabelValues("settle").Inc()
				go h.settleRetry(j, errs[i])
				continue
			}
			h.settled(j, res[i])
		}
	}
}

// settled finishes a settlement: its alerts, metrics and waiters.
func (h *Handler) settled(j settleJob, res limits.SettleResult) {
	if res.WithoutRecord {
		h.m.settlesWithoutRecord.Inc()
	}
	for _, a := range res.Alerts {
		h.alert(a, j.meta)
	}
	h.finishJob(j)
}

func (h *Handler) finishJob(j settleJob) {
	if j.done != nil {
		j.done()
	}
	h.m.pendingSettles.Dec()
	h.pending.Done()
}

// settleRetry settles j on its own, retrying with backoff for up to
// settleGiveUp (lastErr: the failure that sent it here, if any).
func (h *Handler) settleRetry(j settleJob, lastErr error) {
	deadline := time.Now().Add(settleGiveUp)
	backoff := 20 * time.Millisecond
	if lastErr != nil {
		time.Sleep(backoff)
	}
	for {
		res, err := h.cfg.Limiter.SettleOne(context.Background(), j.item)
		if err == nil {
			h.settled(j, res)
			return
		}
		h.m.limitsUnavailable.WithLabelValues("settle").Inc()
		if time.Now().After(deadline) {
			h.m.settleFailures.Inc()
			h.log.Error("giving up settling a request's limits", "request_id", j.item.Lease.RequestID(), "error", err)
			h.finishJob(j)
			return
		}
		time.Sleep(backoff)
		backoff = min(backoff*2, 2*time.Second)
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
	h.enqueueSettle(settleJob{item: limits.SettleItem{Lease: l, Cancel: true}, done: func() { h.pendingCancels.Add(-1) }})
}

// releaseDeploymentLease releases the deployment lease of the current
// attempt, if any (exactly once: the lease is taken out first).
func (x *exchange) releaseDeploymentLease() {
	x.leases.mu.Lock()
	l := x.leases.dep
	x.leases.dep = nil
	x.leases.mu.Unlock()
	if l != nil {
		x.h.settleAsync(l, 0, 0, alertMeta{})
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

// Drain waits until no settlement is pending or ctx ends.
func (h *Handler) Drain(ctx context.Context) error {
	return h.pending.wait(ctx)
}

// pendingCount counts pending settlements. Unlike a sync.WaitGroup it may
// grow while someone waits (a request finishing during Drain): wait
// returns the first time the count is zero.
type pendingCount struct {
	mu   sync.Mutex
	n    int
	zero chan struct{} // closed when n reaches 0; nil while n is 0
}

func (p *pendingCount) Add(d int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == 0 && d > 0 {
		p.zero = make(chan struct{})
	}
	p.n += d
	if p.n == 0 && p.zero != nil {
		close(p.zero)
		p.zero = nil
	}
}

func (p *pendingCount) Done() { p.Add(-1) }

func (p *pendingCount) wait(ctx context.Context) error {
	p.mu.Lock()
	z := p.zero
	p.mu.Unlock()
	if z == nil {
		return nil
	}
	select {
	case <-z:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
