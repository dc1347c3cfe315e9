package gateway

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/forward"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/upstream"
)

// forward tries the candidates in order: one attempt per deployment (a
// retry never goes to a deployment already tried), at most 1+retries
// attempts, within ctx's total deadline, each retry taken from the model
// group's retry budget (over budget: the last attempt's error). clientCtx
// is the client's own context (to tell a disconnect from the deadline).
// The attempts made are in the x-sluice-attempts header and the usage
// event.
//
// The candidates may span the model group's fallback groups
// (fallback.go): they share the attempt budget and the deadline; the
// group whose deployment answered is in the x-sluice-model-group header.
// A failure is answered with the fallback groups skipped named.
func (x *exchange) forward(ctx, clientCtx context.Context, w http.ResponseWriter, cands []candidate) *openai.Error {
	return x.withSkipped(x.attemptAll(ctx, clientCtx, w, cands))
}

func (x *exchange) attemptAll(ctx, clientCtx context.Context, w http.ResponseWriter, cands []candidate) *openai.Error {
	h := x.h
	h.budget.Request(x.group, time.Now())
	var last *openai.Error
	next := 0
	var wait time.Duration // shortest retry-after of a deployment at its cap
	recovering := false    // a deployment's lease count is in quarantine
	maxAttempts := x.maxAttempts()
	holdCuts := 0     // attempts cut within their stream hold (given back, bounded)
	lastHeld := false // the last attempt was cut within its hold
	for x.attempts < maxAttempts+min(holdCuts, HoldCutGrace) {
		if x.attempts > 0 && next < len(cands) {
			// A held cut's retry takes the held cuts' own allowance (the
			// budget's minimum a window) first, then the retry budget; any
			// other retry the retry budget.
			switch {
			case lastHeld && h.holdCutBudget.TryRetry(x.group, time.Now()):
				h.m.holdCutRetries.WithLabelValues(x.group).Inc()
			case !h.budget.TryRetry(x.group, time.Now()):
				h.m.retryRefusals.WithLabelValues(x.group).Inc()
				return pushback(last)
			}
		}
		if x.attempts > 0 {
			// The health of the untried candidates may have changed since
			// the list was made (this request's failures among them): a
			// retry goes to one healthy now.
			restand(cands[next:], time.Now())
			if x.attempts+1 >= maxAttempts+min(holdCuts, HoldCutGrace) {
				// The last attempt the budget allows goes to a deployment
				// proven by a clean stream when there is one.
				preferProven(cands[next:])
			}
		}
		var c *candidate
		// A first attempt queues behind waiting requests of its class or a
		// higher one instead of taking a slot before them (traffic.go).
		if x.attempts > 0 || !h.queues.Ahead(x.group, x.classEnum) {
			var e *openai.Error
			if c, e = x.pick(ctx, cands, &next, &wait, &recovering); e != nil {
				return e
			}
		}
		if c == nil && last == nil && !recovering && x.attempts == 0 {
			var e *openai.Error
			if c, e = x.queue(ctx, cands, wait); e != nil {
				return e
			}
		}
		if c == nil {
			if last != nil {
				if h.budget.Pushback(x.group, time.Now()) {
					return pushback(last)
				}
				return last
			}
			if recovering {
				return openai.Unavailable(openai.CodeLimitsRecovering, "the limits store restarted moments ago; deployment concurrency is re-counted, retry shortly", max(wait, 100*time.Millisecond))
			}
			x.shed = x.attempts == 0
			return openai.Unavailable(openai.CodeOverloaded, fmt.Sprintf("every deployment of model %q is at its concurrency limit", x.group), max(wait, time.Second))
		}
		if x.attempts > 0 {
			h.series.group(x.group).retries.Inc()
		}
		x.attempts++
		state := c.standing.Label(&c.st.Health, time.Now())
		w.Header().Set(openai.HeaderAttempts, strconv.Itoa(x.attempts))
		w.Header().Set(openai.HeaderModelGroup, c.d.GetModelGroup())
		x.dep = c.d
		x.placeSession(c.d.GetId()) // a new session counts on the deployment while its turn runs (affinity.go)
		x.progressAttempt()
		out := x.attemptHeld(ctx, clientCtx, w, c)
		h.attemptSeries(c.d.GetId(), state, x.attemptOutcome(out)).Inc()
		if out.Err == nil {
			return nil
		}
		if !out.Retry {
			return out.Err
		}
		if lastHeld = out.HoldCut; lastHeld {
			holdCuts++
		}
		last = out.Err
	}
	if last != nil && h.budget.Pushback(x.group, time.Now()) {
		return pushback(last) // every attempt failed and the pool's retries are past what clients may add to
	}
	return last
}

// pick takes a slot on the first candidate from *next on that has one
// (the per-instance count, then the fleet-wide lease with the class
// scopes); nil when none has. wait and recovering collect the shortest
// retry-after of those at their caps and whether a lease count is in
// quarantine.
func (x *exchange) pick(ctx context.Context, cands []candidate, next *int, wait *time.Duration, recovering *bool) (*candidate, *openai.Error) {
	// Prefill isolation (gate.go): an interactive request's candidate
	// without agent prefill first, its prefill registered there.
	placed, e := x.placeInteractive(ctx, cands, *next)
	if e != nil {
		return nil, e
	}
	c, e := x.pickFrom(ctx, cands, next, wait, recovering, placed)
	if placed != nil && (c == nil || c.d.GetId() != placed.Deployment) {
		// Served elsewhere (the placed deployment had no slot) or not at
		// all: the entry would keep agents off a deployment it is not on.
		x.h.dropGate(placed)
	}
	return c, e
}

func (x *exchange) pickFrom(ctx context.Context, cands []candidate, next *int, wait *time.Duration, recovering *bool, placed *limits.GateEntry) (*candidate, *openai.Error) {
	refusedEst := int64(-1) // the estimate on the first deployment the gate refused
	for ; *next < len(cands); *next++ {
		cand := &cands[*next]
		// A half-open deployment takes one probe at a time; while another
		// request's probe runs it is skipped.
		probe := cand.standing == upstream.Probe
		if probe && !cand.st.Health.TryProbe() {
			continue
		}
		release := func() {
			cand.st.Slots.Release()
			if probe {
				cand.st.Health.EndProbe()
			}
		}
		if !cand.st.Slots.TryAcquire(cand.d.GetMaxConcurrency()) {
			if probe {
				cand.st.Health.EndProbe()
			}
			continue
		}
		est := x.prefillEstimate(cand.d)
		// Prefill isolation (gate.go): an agent or batch attempt's prefill
		// is registered at its group's gate first. The gate never makes a
		// request prefill more than on a deployment it refused: a later
		// candidate whose estimate is higher (a session's engine holds its
		// conversation) is not taken, the request waits instead.
		if refusedEst >= 0 && est > refusedEst+minPrefillGain {
			release()
			continue
		}
		gate, open, e := x.enterGate(ctx, cand.d)
		if e != nil {
			release()
			return nil, e
		}
		if !open {
			release()
			if refusedEst < 0 {
				refusedEst = est
			}
			if *wait == 0 || limits.GateRetryAfter < *wait {
				*wait = limits.GateRetryAfter
			}
			continue
		}
		if placed != nil && placed.Deployment == cand.d.GetId() {
			gate = placed
		}
		// The fleet-wide max_concurrency lease (Redis), after the
		// per-instance one, with the attempt's prefill (prefill.go).
		dl, rej, e := x.admitDeployment(ctx, cand.d, est)
		switch {
		case e != nil:
			release()
			if gate != placed {
				x.h.dropGate(gate)
			}
			return nil, e
		case rej != nil:
			release()
			if gate != placed {
				x.h.dropGate(gate) // before the next candidate: its gate must not count this entry
			}
			if *wait == 0 || rej.RetryAfter < *wait {
				*wait = rej.RetryAfter
			}
			*recovering = *recovering || rej.Quarantined
			continue
		}
		if dl != nil {
			x.leases.setDep(dl)
		}
		if dl != nil || gate != nil {
			x.startRenewal()
		}
		x.startPrefill(cand.d, est, dl, gate)
		x.chargeServed()
		*next++
		return cand, nil
	}
	return nil, nil
}

// attemptOutcome names an attempt's outcome in
// sluice_proxy_upstream_attempts_total{outcome}: ok, retryable (failed
// before any byte reached the client, another deployment may serve it),
// failed (the request's answer is an error: not retryable, or a stream
// that failed after its first event), client_closed.
func (x *exchange) attemptOutcome(out forward.Outcome) string {
	switch {
	case out.Err == nil && x.errCode == openai.CodeClientClosed, out.Err != nil && out.Err.Code == openai.CodeClientClosed:
		return "client_closed"
	case out.Err == nil && x.errCode == "":
		return "ok"
	case out.Retry:
		return "retryable"
	}
	return "failed"
}

// HoldCutGrace bounds the attempts a request gets back for its attempts
// whose held stream (a half-open probe's, or one on stream probation) was
// cut within the hold (forward.Outcome.HoldCut): each such attempt adds
// one to the request's attempt budget, at most HoldCutGrace in all. The
// hold exists so that such a cut is retried instead of reaching the
// client; counted as an ordinary attempt it would take the attempt a
// healthy deployment needed (a cutter on probation, a 503 and a 429
// before the healthy one). Every retry still takes from the model
// group's retry budget, and the total deadline is the same: the grace
// adds at most HoldCutGrace attempts to one request (docs/resilience.md, "One attempt budget per
// request"). A held cut's retry takes Handler.holdCutBudget, the held
// cuts' own allowance, first: the retry budget's minimum per window
// (beyond its ratio: a constant rate, never a storm), then the retry
// budget. Held cuts come in bursts at a cold start, when every
// deployment is on probation and the ratio has no request history yet:
// on the retry budget they spent the retries its minimum keeps for
// finding out the rest of a brownout (a 503, a 429). Without the
// probation those cuts reached clients and cost no retry.
const HoldCutGrace = 2

// preferProven moves the healthy candidates proven by a clean stream
// (upstream.Probation, with the stream probation on) ahead of the other
// candidates of the best rank, each part in its order (byStanding's
// order is kept otherwise): the request's last attempt goes where a
// stream was last seen to end cleanly rather than to a deployment still
// unproven, which may be the cutter whose cut is why the request is
// retrying. A first attempt is never reordered this way (an unproven
// deployment is proven by its first attempts).
func preferProven(cands []candidate) {
	slices.SortStableFunc(cands, func(a, b candidate) int {
		return cmp.Compare(provenRank(a), provenRank(b))
	})
}

func provenRank(c candidate) int {
	r := 2 * c.standing.Rank()
	if c.standing != upstream.Healthy || !c.st.Health.Probation.Proven() {
		r++
	}
	return r
}

// restand refreshes the standing of untried candidates from their health
// at now and reorders them by it (byStanding): one that failed, was
// parked or ejected since the list was made moves behind the healthy
// ones, one whose ejection ended becomes a probe. Panic stands.
func restand(cands []candidate, now time.Time) {
	for i := range cands {
		c := &cands[i]
		h := &c.st.Health
		switch {
		case c.standing == upstream.Panic:
		case !h.Ejected(now) && h.HalfOpen(now):
			c.standing = upstream.Probe
		case !h.Ejected(now):
			c.standing = upstream.Healthy
		default:
			if reason, _, out := h.Out(now); out && reason == upstream.OutParked {
				c.standing = upstream.CappedParked
			} else {
				c.standing = upstream.Capped
			}
		}
	}
	byStanding(cands)
}

// pushback is the answer of a request whose retry the model group's
// retry budget refused: its last error, with x-should-retry: false (the
// pool is browning out: a client retry now adds the load the budget just
// kept away; gRPC's retry pushback) and the retry-after of that error, so
// stock SDKs do not multiply the attempts while a client that comes back
// later knows when.
func pushback(e *openai.Error) *openai.Error {
	if e == nil {
		return nil
	}
	out := *e
	out.NoRetry, out.Retry = true, false
	return &out
}

// maxAttempts is the request's attempt budget: the model group's
// max_attempts, else 1 + the proxy's --max-retries.
func (x *exchange) maxAttempts() int {
	if n := x.cat.ModelGroup(x.group).GetResilience().GetMaxAttempts(); n > 0 {
		return int(n)
	}
	return 1 + x.h.retries
}

// policy is the resilience settings of the model group's attempts (its
// admin resilience settings; zero fields: the proxy's flags).
func (x *exchange) policy(group string) forward.Policy {
	r := x.cat.ModelGroup(group).GetResilience()
	return forward.Policy{TTFTTimeout: time.Duration(r.GetTtftTimeoutMs()) * time.Millisecond,
		EjectBase: time.Duration(r.GetEjectionBaseMs()) * time.Millisecond, EjectMax: time.Duration(r.GetEjectionMaxMs()) * time.Millisecond}
}

// attemptHeld runs one attempt on c and releases what the attempt holds
// (the per-instance slot, the in-flight gauge, the deployment lease) on
// every exit, panics included.
func (x *exchange) attemptHeld(ctx, clientCtx context.Context, w http.ResponseWriter, c *candidate) forward.Outcome {
	g := x.h.series.upstreamInFlight(c.d.GetId())
	g.Inc()
	x.h.queues.Started(x.classEnum)
	defer func() {
		g.Dec()
		x.endPrefill(false) // the lease's release below removes its fleet-wide part
		x.h.queues.Ended(x.classEnum)
		if c.standing == upstream.Probe {
			c.st.Health.EndProbe() // the attempt's outcome closed, re-ejected or left it half-open
		}
		c.st.Slots.Release()
		x.releaseDeploymentLease()
		x.h.queues.Notify(x.group) // a slot of this proxy's is free
	}()
	pol := x.policy(c.d.GetModelGroup())
	// A half-open deployment's probe holds its stream back until it ends
	// cleanly: a cut within the hold is retried elsewhere, not relayed;
	// so does a stream to a deployment on probation.
	pol.Probe = c.standing == upstream.Probe
	pol.Probation = x.h.probation
	return x.h.fwd.Attempt(ctx, clientCtx, w, x, c.d, c.st, pol)
}

func (x *exchange) setUsage(u *openai.Usage) {
	x.usageSeen = true
	x.prompt, x.completion = u.PromptTokens, u.CompletionTokens
	if u.PromptTokensDetails != nil {
		x.cached = u.PromptTokensDetails.CachedTokens
	}
	x.cacheCreation = u.CacheCreationTokens
	x.progressUsage()
	x.correctPrefill(x.prompt, x.cached)
}

// The exchange as forward.Exchange: what an attempt reports.

func (x *exchange) RequestID() string                 { return x.id }
func (x *exchange) Route() string                     { return x.route }
func (x *exchange) Request() *openai.Request          { return x.req }
func (x *exchange) UpstreamAnswered(b bool)           { x.upstreamAnswered = b }
func (x *exchange) Usage(u *openai.Usage)             { x.setUsage(u) }
func (x *exchange) SetStatus(status int)              { x.status = status }
func (x *exchange) SetErrorCode(code string)          { x.errCode = code }
func (x *exchange) SetResult(status int, code string) { x.status, x.errCode = status, code }

// Relaying is called before anything of a 2xx answer reaches the client:
// a new session's placement is in Redis before the client can send its
// next turn (awaitPlacement).
func (x *exchange) Relaying(streamed bool) {
	x.awaitPlacement()
	x.progressAnswer(streamed)
}

// FirstByte records the stream's time to first token (once).
func (x *exchange) FirstByte() {
	if x.ttft == 0 {
		x.ttft = time.Since(x.start)
		x.progressFirstByte()
		x.endPrefill(true)
	}
}

// FirstEvent ends the attempt's prefill at the engine's first event, held
// back or relayed.
func (x *exchange) FirstEvent() { x.endPrefill(true) }

// StreamHold records a held stream's hold: in the access log
// (stream_hold, stream_held_ms).
func (x *exchange) StreamHold(reason, outcome string, held time.Duration) {
	if x.holds != "" {
		x.holds += ","
	}
	x.holds += reason + ":" + outcome
	if outcome != forward.HoldCut && outcome != forward.HoldAborted {
		x.held = held
	}
}

// ContentChunk counts a relayed chunk carrying text.
func (x *exchange) ContentChunk() {
	x.contentChunks++
	x.progressChunk()
}
