package gateway

import (
	"context"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/internal/budget"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// Lost proxies (issue 19; docs/limits.md, "Lost proxies"). A limited
// request is admitted sweepable: its admission and every renewal carry a
// report, the usage a sweeper charges and the usage event it publishes if
// this process dies before settling. The report is a bound: it covers the
// tokens relayed so far plus the headroom of the stream's current rate for
// the next two renew intervals (at least minHeadroom; before the stream's
// first renewal, startRate), and a stream that relays past it renews at
// once (kick), so the ledger never records fewer tokens than the client
// received, short of the one round trip a kicked renewal takes. Every data plane runs a sweeper (RunSweeper) that settles
// the requests whose leases expired unsettled and publishes their events.

// statusProxyLost is the status recorded for a lost request whose client
// had not received a status yet (the client saw its connection drop).
const statusProxyLost = 502

// minHeadroom is the least completion-token headroom a stream's report
// gives beyond what it relayed.
const minHeadroom = 16

// startRate (tokens per second) is the rate a stream's reports assume
// until it has relayed for a renew interval: the admission's report covers
// two renew intervals at it, so a stream renews early only when it relays
// faster.
const startRate = 100

// sweepPerPass bounds the requests one sweep pass settles; a pass that
// reaches it is followed by another soon.
const sweepPerPass = limits.DefaultSweepLimit

// progress is what a renewal's report reads of an exchange while the
// request's goroutine changes it. Fields before mu are written once
// before the first renewal and read freely.
type progress struct {
	mu       sync.Mutex
	dep      *catalog.Deployment
	attempts int
	// answered: a 2xx answer is being relayed (streamed: SSE).
	answered, streamed bool
	status             int
	answeredAt         time.Time
	usageSeen          bool
	prompt, completion int64
	cached             int64
	ttft               time.Duration
	// lastChunks and lastAt are the chunks at, and time of, the last
	// report (the stream's rate).
	lastChunks int64
	lastAt     time.Time

	// chunks counts relayed content chunks; kickAt is one more than the
	// completion tokens the last report covers: the chunk count that kicks
	// a renewal (0: none).
	chunks atomic.Int64
	kickAt atomic.Int64
}

// attempt records the deployment of an attempt.
func (x *exchange) progressAttempt() {
	p := &x.prog
	p.mu.Lock()
	p.dep, p.attempts = x.dep, x.attempts
	p.mu.Unlock()
}

// progressAnswer records that a 2xx answer is being relayed. A stream
// reports at once: its report now names the deployment, its price and the
// 200 the client got (at most one renewal more per stream; streams
// longer than a renew interval renew anyway).
func (x *exchange) progressAnswer(streamed bool) {
	p := &x.prog
	p.mu.Lock()
	p.answered, p.streamed, p.status, p.answeredAt = true, streamed, x.status, time.Now()
	p.mu.Unlock()
	if streamed {
		x.kickRenewal()
	}
}

// progressFirstByte records the stream's time to first token.
func (x *exchange) progressFirstByte() {
	p := &x.prog
	p.mu.Lock()
	p.ttft = x.ttft
	p.mu.Unlock()
}

// progressUsage records the usage the upstream reported (the request
// finishes right after: no renewal is kicked for it).
func (x *exchange) progressUsage() {
	p := &x.prog
	p.mu.Lock()
	p.usageSeen, p.prompt, p.completion, p.cached = true, x.prompt, x.completion, x.cached
	p.mu.Unlock()
}

// progressChunk counts a relayed content chunk and renews at once when
// the stream relayed past its last report.
func (x *exchange) progressChunk() {
	if k := x.prog.kickAt.Load(); x.prog.chunks.Add(1) >= k && k > 0 {
		x.kickRenewal()
	}
}

// kickRenewal renews (and reports) now, for a sweepable request.
func (x *exchange) kickRenewal() {
	if r := x.renewal; r != nil && x.lease != nil && x.lease.Sweepable() {
		r.kick()
	}
}

// report returns the exchange's report as of now (see the top of this
// file): the usage a sweeper charges if this process dies, and the usage
// event it publishes then.
func (x *exchange) report(now time.Time) limits.Report {
	u := x.reportUsage(now)
	return x.reportOf(now, u)
}

// reportedUsage is what a report covers (reportUsage).
type reportedUsage struct {
	prompt, completion, cached int64
	dep                        *catalog.Deployment
	attempts, status           int
	ttft                       time.Duration
}

// reportUsage returns the usage a report made now covers, and makes it
// the last report (the stream's rate is measured from it, and relaying
// past its bound kicks a renewal).
func (x *exchange) reportUsage(now time.Time) reportedUsage {
	p := &x.prog
	p.mu.Lock()
	chunks := p.chunks.Load()
	// The prompt is charged from the admission on (the engine may have
	// read it), at the estimate until the upstream reports usage.
	prompt, completion, cached := x.req.PromptEstimate(), int64(0), int64(0)
	bound := int64(math.MaxInt64)
	switch {
	case p.usageSeen:
		prompt, completion, cached = p.prompt, p.completion, p.cached
	case x.req.Stream() && !(p.answered && !p.streamed):
		iv := x.h.renewInterval()
		// What the stream relays in two renew intervals (the next renewal
		// is due in one): at startRate until it relayed for an interval,
		// then at its rate since the last report.
		head := int64(math.Ceil(startRate * 2 * iv.Seconds()))
		if p.answered && !p.lastAt.IsZero() && now.Sub(p.answeredAt) >= iv {
			if dt := now.Sub(p.lastAt); dt > 0 {
				head = max(minHeadroom, int64(math.Ceil(float64(chunks-p.lastChunks)*float64(2*iv)/float64(dt))))
			}
		}
		// No more than the request can produce (its estimate), unless the
		// engine already relayed beyond it.
		completion = chunks + head
		if chunks < x.estTokens {
			completion = min(completion, x.estTokens)
		}
		bound = completion
	}
	// A complete (non-streamed) answer is read whole before any of it is
	// relayed, and its usage comes with it: nothing more to report.
	p.lastChunks, p.lastAt = chunks, now
	if bound == math.MaxInt64 {
		p.kickAt.Store(0)
	} else {
		p.kickAt.Store(bound + 1)
	}
	u := reportedUsage{prompt: prompt, completion: completion, cached: cached, dep: p.dep, attempts: p.attempts, status: p.status, ttft: p.ttft}
	p.mu.Unlock()
	return u
}

// reportOf builds the report of usage u as of now: the usage event a
// sweeper publishes, marshaled.
func (x *exchange) reportOf(now time.Time, u reportedUsage) limits.Report {
	prompt, completion, cached, dep, attempts, status, ttft := u.prompt, u.completion, u.cached, u.dep, u.attempts, u.status, u.ttft
	if status == 0 {
		status = statusProxyLost
	}
	ev := &usagev1.UsageEvent{
		RequestId: x.id, Time: timestamppb.New(x.start), Region: x.h.cfg.Region, InstanceId: x.h.cfg.InstanceID,
		Customer: x.customer, AgentId: x.agent, SessionId: x.session, Route: x.route, ModelGroup: x.group,
		PromptTokens: prompt, CompletionTokens: completion, CachedTokens: cached,
		Status: int32(status), ErrorCode: openai.CodeProxyLost, LatencyMs: now.Sub(x.start).Milliseconds(), TtftMs: ttft.Milliseconds(),
		Attempts: int32(attempts), RequestedModel: x.req.Model(), Stream: x.req.Stream(),
	}
	if pr := x.p; pr != nil {
		ev.KeyId, ev.UserId, ev.TeamId, ev.OrgId, ev.Project = pr.Key.GetId(), pr.Key.GetUserId(), pr.Key.GetTeamId(), pr.Key.GetOrgId(), pr.Key.GetProject()
		ev.Tags = pr.Key.GetTags()
		ev.TrafficClass, ev.TrafficClassReason = x.class, x.classReason
	}
	if dep != nil {
		ev.DeploymentId = dep.GetId()
		ev.CostUsd = cost(dep.GetPrices(), prompt, cached, completion)
	} else {
		// Not forwarded yet: priced like the reservation, at the highest
		// prices of the candidates.
		ev.CostUsd = cost(x.lostPrices, prompt, cached, completion)
	}
	data, err := proto.Marshal(ev)
	if err != nil {
		x.h.log.Error("encode the usage report of a request", "request_id", x.id, "error", err)
	}
	return limits.Report{Tokens: prompt + completion, CostMicros: budget.Micros(ev.CostUsd), Event: data}
}

// admissionReporter is an exchange as the limits.Reporter of its
// admission: the report is built only if the admission writes a record
// (an exact one); a request admitted entirely from quota slices sends its
// first report with a renewal.
type admissionReporter exchange

func (r *admissionReporter) Report() limits.Report { return (*exchange)(r).report(time.Now()) }

// setHighestPrices sets out to the highest input, cached-input and output
// prices of the candidates.
func setHighestPrices(out *configv1.Prices, cands []candidate) {
	for _, c := range cands {
		pr := c.d.GetPrices()
		out.InputPerToken = max(out.InputPerToken, pr.GetInputPerToken())
		out.CachedInputPerToken = max(out.CachedInputPerToken, pr.GetCachedInputPerToken())
		out.OutputPerToken = max(out.OutputPerToken, pr.GetOutputPerToken())
	}
}

func (h *Handler) renewInterval() time.Duration {
	if h.cfg.Limiter == nil {
		return limits.DefaultRenewInterval
	}
	return h.cfg.Limiter.RenewInterval()
}

// sweepMetrics are the series of lost-proxy handling (docs/metrics.md).
type sweepMetrics struct {
	swept      *prometheus.CounterVec
	passes     prometheus.Counter
	errors     prometheus.Counter
	foundSwept *prometheus.CounterVec
}

func newSweepMetrics(reg prometheus.Registerer) (*sweepMetrics, error) {
	m := &sweepMetrics{
		swept: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_limits_swept_total",
			Help: "Requests whose lease expired unsettled (their proxy was lost) that this instance's sweeper settled with their last report, by whether their usage event was published (published, missing).",
		}, []string{"event"}),
		passes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sluice_proxy_limits_sweep_passes_total",
			Help: "Sweep passes over the lease indexes of the orgs of the catalog.",
		}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sluice_proxy_limits_sweep_errors_total",
			Help: "Sweep passes that failed in part (limits store unavailable); their requests are found again by the next pass.",
		}),
		foundSwept: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_proxy_limits_found_swept_total",
			Help: "Requests of this instance that a sweeper had settled while they still ran (renewals late by a whole lease TTL), by the call that found out (renew: the request was stopped; settle: a no-op).",
		}, []string{"op"}),
	}
	for _, c := range []prometheus.Collector{m.swept, m.passes, m.errors, m.foundSwept} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// RunSweeper settles, every Limiter.SweepInterval (jittered), the
// requests of the catalog's orgs whose leases expired unsettled, and
// records their usage events, until ctx ends. Every data plane runs one;
// of several racing for a request exactly one settles it (package limits).
func (h *Handler) RunSweeper(ctx context.Context) error {
	lim := h.cfg.Limiter
	if lim == nil {
		<-ctx.Done()
		return nil
	}
	interval := lim.SweepInterval()
	jitter := func() time.Duration { return interval*9/10 + rand.N(interval/5+1) }
	t := time.NewTimer(jitter())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		next := jitter()
		if h.sweepOnce(ctx) >= sweepPerPass {
			next = min(next, 100*time.Millisecond) // more are waiting
		}
		t.Reset(next)
	}
}

// sweepOnce runs one sweep pass and returns how many requests it settled.
func (h *Handler) sweepOnce(ctx context.Context) int {
	cat := h.cfg.Catalog()
	if cat == nil || h.cfg.Limiter == nil {
		return 0
	}
	h.sm.passes.Inc()
	swept, err := h.cfg.Limiter.Sweep(ctx, cat.OrgIDs(), sweepPerPass)
	if err != nil {
		h.sm.errors.Inc()
		h.log.Warn("sweeping lost requests failed; the next pass retries", "error", err)
	}
	for _, s := range swept {
		h.swept(s)
	}
	// Budget leases of quota slices whose data plane is gone: reclaimed
	// here too, for scopes no live data plane calls for any more.
	if _, err := h.cfg.Limiter.ReclaimBudgetLeases(ctx, cat.OrgIDs(), sweepPerPass); err != nil {
		h.sm.errors.Inc()
		h.log.Warn("reclaiming expired budget leases failed; the next pass retries", "error", err)
	}
	return len(swept)
}

// swept records the usage event and alerts of a request a sweep settled.
func (h *Handler) swept(s limits.Swept) {
	ev := &usagev1.UsageEvent{}
	if len(s.Event) == 0 || proto.Unmarshal(s.Event, ev) != nil || ev.GetRequestId() != s.RequestID {
		h.sm.swept.WithLabelValues("missing").Inc()
		h.log.Error("settled a lost proxy's request without a usable usage event", "request_id", s.RequestID, "org_id", s.OrgID,
			"tokens", s.Tokens, "cost_usd", usd(s.CostMicros))
		ev = nil
	} else {
		h.sm.swept.WithLabelValues("published").Inc()
		h.log.Warn("settled a lost proxy's request with its last report", "request_id", s.RequestID, "org_id", s.OrgID,
			"proxy_instance", ev.GetInstanceId(), "tokens", s.Tokens, "cost_usd", usd(s.CostMicros))
	}
	meta := alertMeta{requestID: s.RequestID, orgID: s.OrgID}
	if ev != nil {
		meta.keyTeam, meta.teamID = ev.GetTeamId(), ev.GetTeamId()
		h.cfg.Usage.Record(ev)
	}
	for _, a := range s.Alerts {
		h.alert(a, meta)
	}
}
