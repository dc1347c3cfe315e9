// Package forward runs one upstream attempt of a request and relays its
// answer: the upstream request (the body rewritten for the deployment),
// the classification of failures (retryable or not, typed errors of the
// openai table), the deployment's health (upstream.State), and the relay
// of a complete answer, or an SSE stream event by
// event. Which deployment to try and how often is the gateway's (its
// forward stage); what the attempt observes (status, usage, first byte,
// chunks) is reported to the request through Exchange.
package forward

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/upstream"
)

// maxResponseBytes bounds a non-streaming upstream answer held in memory
// (large embedding batches fit).
const maxResponseBytes = 64 << 20

// Outcome is the result of one upstream attempt.
type Outcome struct {
	// Err is the answer when the attempt failed (nil: the client got its
	// answer).
	Err *openai.Error
	// Retry says another deployment may be tried: nothing reached the
	// client and the failure is retryable.
	Retry bool
	// HoldCut says the attempt was a held stream (Policy.Probe,
	// Policy.Probation) cut by its engine within the hold, after its
	// first event: the hold turned what would have been a cut at the
	// client into this retryable failure. The gateway gives such an
	// attempt back to the request's attempt budget, bounded
	// (docs/resilience.md, "One attempt budget per request").
	HoldCut bool
}

// Exchange is the request an attempt serves: what it reads of it and
// what it reports (the gateway's exchange implements it; calls come from
// the request's goroutine).
type Exchange interface {
	RequestID() string
	Route() string
	Request() *openai.Request
	// UpstreamBody is the body to send to deployment d (the request
	// rewritten for it: model, stream options, engine priority).
	UpstreamBody(d *catalog.Deployment) []byte
	// UpstreamAnswered records whether an upstream answer may be charged
	// (it sent response headers and generated something).
	UpstreamAnswered(bool)
	// Relaying records that a 2xx answer is being relayed (streamed: SSE);
	// nothing of the answer has reached the client yet.
	Relaying(streamed bool)
	// FirstByte records that the first event of a stream was relayed.
	FirstByte()
	// FirstEvent records that the engine sent a stream's first event
	// (relayed, or held back: Policy.Probe, Policy.Probation): its
	// prefill is over.
	FirstEvent()
	// StreamHold records how a held stream's hold ended (reason
	// HoldProbe or HoldProbation; outcome HoldDone, HoldReleased,
	// HoldBounds, HoldCut, HoldAborted) and how long its first event was
	// held.
	StreamHold(reason, outcome string, held time.Duration)
	// Usage records the usage the upstream reported.
	Usage(*openai.Usage)
	// ContentChunk counts a relayed stream chunk carrying text.
	ContentChunk()
	// SetStatus, SetErrorCode and SetResult record the answer's status and
	// error code.
	SetStatus(int)
	SetErrorCode(string)
	SetResult(status int, code string)
}

// Forwarder runs attempts.
type Forwarder struct {
	// Client reaches the upstreams (upstream.NewClient).
	Client *http.Client
	// Log takes the operator's warnings (never a credential).
	Log *slog.Logger
	// RequestTimeout is the request's total deadline (for its message).
	RequestTimeout time.Duration
	// ParkMax caps the parking of a deployment (and the retry-after
	// passed on) whatever Retry-After the engine sent.
	ParkMax time.Duration
	// TTFTTimeout, when positive, abandons a stream attempt that has
	// relayed nothing that long after it started (retried elsewhere when
	// the request's attempt budget allows).
	TTFTTimeout time.Duration
	// EjectBase and EjectMax are the default ejection backoff of a
	// failing deployment (0: upstream.EjectBase, upstream.EjectMax).
	EjectBase, EjectMax time.Duration
	// LeaseLost is the cancel cause of a request whose limits leases
	// could not be renewed: it fails with 503 limits_unavailable.
	LeaseLost error
	// UpstreamError and Ejection count failures by deployment and kind,
	// and ejections by deployment and reason (the gateway's metrics).
	UpstreamError func(deployment, kind string)
	Ejection      func(deployment, reason string)
	// Hold counts held streams by deployment, reason and outcome;
	// Probation counts a deployment's stream probation ending ("proven")
	// and starting again ("revoked"). Nil: not counted.
	Hold      func(deployment, reason, outcome string)
	Probation func(deployment, event string)
}

func (f *Forwarder) probation(dep, event string) {
	if f.Probation != nil {
		f.Probation(dep, event)
	}
}

// Policy is the resilience settings of one attempt, from the model group
// of its deployment; a zero field takes the Forwarder's (the proxy's
// flags).
type Policy struct {
	// TTFTTimeout replaces Forwarder.TTFTTimeout when positive.
	TTFTTimeout time.Duration
	// EjectBase and EjectMax are the ejection backoff (upstream.Health).
	EjectBase, EjectMax time.Duration
	// Probe says the attempt is the probe of a half-open deployment
	// (upstream.Probe): its stream is held back from the client until it
	// ends cleanly, or ProbeHoldMax / ProbeHoldBytes pass, so that a cut
	// within the hold is retried elsewhere instead of reaching the client.
	Probe bool
	// Probation turns the stream probation on (--stream-probation): a
	// stream to a deployment on probation (upstream.Probation: not yet
	// seen streaming cleanly by this instance, or cut or ejected since)
	// is held like a probe's; the first stream that ends cleanly or
	// outlives the hold proves the deployment and releases the streams
	// held on it; a cut puts it back on probation.
	Probation bool
}

// A held stream (Policy.Probe, Policy.Probation) is held back until it
// ends, at most ProbeHoldMax after its first event or ProbeHoldBytes of
// events (or, on probation, until another stream proves its
// deployment); then it is relayed as any other.
const (
	ProbeHoldMax   = 2 * time.Second
	ProbeHoldBytes = 256 << 10
)

// call is one attempt in progress.
type call struct {
	f   *Forwarder
	x   Exchange
	d   *catalog.Deployment
	st  *upstream.State
	pol Policy
	// wrote is set once a byte of the answer went to the client (from
	// then on the attempt is never retried, nor abandoned at its TTFT
	// deadline).
	wrote atomic.Bool
	// started is set once the stream's first event to relay arrived (held
	// or relayed): from then on its TTFT deadline has passed.
	started atomic.Bool
	// wire is the wire format of the route's answers (wire.go).
	wire wire
}

// Attempt runs one attempt of x on deployment d (st its runtime state)
// within ctx (the request's deadline); clientCtx is the client's own
// context, to tell a disconnect from the deadline.
// pol is the attempt's policy (its deployment's model group).
func (f *Forwarder) Attempt(ctx, clientCtx context.Context, w http.ResponseWriter, x Exchange, d *catalog.Deployment, st *upstream.State, pol Policy) Outcome {
	if pol.TTFTTimeout <= 0 {
		pol.TTFTTimeout = f.TTFTTimeout
	}
	if pol.EjectBase <= 0 {
		pol.EjectBase = f.EjectBase
	}
	if pol.EjectMax <= 0 {
		pol.EjectMax = f.EjectMax
	}
	return (&call{f: f, x: x, d: d, st: st, pol: pol, wire: wireFor(x)}).attempt(ctx, clientCtx, w)
}

// upstreamURL joins a deployment's api_base (".../v1") and a route.
func upstreamURL(apiBase, route string) string {
	return strings.TrimSuffix(apiBase, "/") + strings.TrimPrefix(route, "/v1")
}

func (a *call) attempt(ctx, clientCtx context.Context, w http.ResponseWriter) Outcome {
	d := a.d
	if a.x.Request().Stream() && a.pol.TTFTTimeout > 0 {
		// The TTFT deadline: an attempt that has relayed nothing when it
		// passes is abandoned (and may be retried elsewhere); one that has
		// relayed its first event (or, a probe, holds it) runs on under the
		// total deadline.
		var cancel context.CancelCauseFunc
		ctx, cancel = context.WithCancelCause(ctx)
		defer cancel(nil)
		t := time.AfterFunc(a.pol.TTFTTimeout, func() {
			if !a.started.Load() {
				cancel(errTTFT)
			}
		})
		defer t.Stop()
	}
	body := a.x.UpstreamBody(d)
	ureq, err := http.NewRequestWithContext(ctx, http.MethodPost, upstreamURL(d.GetApiBase(), a.x.Route()), bytes.NewReader(body))
	if err != nil {
		a.f.Log.Error("bad upstream URL", "deployment", d.GetId(), "error", err)
		return Outcome{Err: openai.UpstreamFailed("the deployment's upstream address is invalid"), Retry: true}
	}
	ureq.Header.Set("Content-Type", "application/json")
	ureq.Header.Set("X-Request-Id", a.x.RequestID())
	if d.Credential != "" {
		ureq.Header.Set("Authorization", "Bearer "+d.Credential)
	}
	resp, err := a.f.Client.Do(ureq)
	if err != nil {
		return a.transportFailure(ctx, clientCtx, err)
	}
	a.x.UpstreamAnswered(true)
	switch s := resp.StatusCode; {
	case s >= 200 && s < 300:
		if a.x.Request().Stream() && strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
			return a.relayStream(ctx, clientCtx, w, resp)
		}
		a.st.Health.Succeeded()
		return a.relayBody(ctx, clientCtx, w, resp)
	case s == http.StatusServiceUnavailable || s == http.StatusTooManyRequests:
		// Overload and rate limits: another deployment of the pool may
		// have room. Never the client's raw answer: a typed error with the
		// engine's Retry-After (capped), and the deployment parked for it.
		a.x.UpstreamAnswered(false) // nothing generated: charge nothing
		ra := min(retryAfter(resp.Header), a.f.ParkMax)
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		drain(resp.Body)
		if ra > 0 {
			a.st.Health.Park(time.Now(), ra)
			a.st.MarkOut(upstream.OutParked)
			a.f.Ejection(d.GetId(), "parked")
		}
		if s == http.StatusTooManyRequests {
			a.f.UpstreamError(d.GetId(), "status_429")
			return Outcome{Err: openai.UpstreamRateLimited("the model server is rate limiting requests (HTTP 429)", ra), Retry: true}
		}
		if openai.EngineBackpressure(b) {
			// vLLM's admission valve: backpressure, not a failure.
			a.f.UpstreamError(d.GetId(), "status_503_queue_full")
			return Outcome{Err: openai.UpstreamOverloaded("the model server's queue is full (HTTP 503)", ra), Retry: true}
		}
		a.f.UpstreamError(d.GetId(), "status_5xx")
		a.unhealthy()
		return Outcome{Err: openai.UpstreamOverloaded("the model server is unavailable (HTTP 503)", ra), Retry: true}
	case s == http.StatusBadGateway || s == http.StatusGatewayTimeout:
		a.x.UpstreamAnswered(false)
		drain(resp.Body)
		a.f.UpstreamError(d.GetId(), "status_5xx")
		a.unhealthy()
		if s == http.StatusGatewayTimeout {
			return Outcome{Err: openai.UpstreamTimeout("the model server timed out (HTTP 504)", true), Retry: true}
		}
		return Outcome{Err: openai.UpstreamFailed("the model server failed (HTTP 502)"), Retry: true}
	case s >= 500:
		// 500, 501, …: the engine may have run the request; not retried.
		a.x.UpstreamAnswered(false)
		drain(resp.Body)
		a.f.UpstreamError(d.GetId(), "status_5xx")
		a.unhealthy()
		return Outcome{Err: openai.UpstreamFailed(fmt.Sprintf("the model server failed (HTTP %d)", s))}
	default:
		// Any other 4xx: a typed answer (upstream_bad_request, or
		// upstream_auth_failed for the deployment's credential).
		a.x.UpstreamAnswered(false)
		return a.upstreamRejected(ctx, clientCtx, resp)
	}
}

// errTTFT is the cancel cause of an attempt abandoned at its TTFT deadline.
var errTTFT = errors.New("no first token within the TTFT deadline")

// unhealthy records a connect failure, 5xx or stream cut.
func (a *call) unhealthy() { a.failed(false) }

// cutAfterBytes records a stream cut after bytes reached the client: it
// ejects the deployment at once when other attempts of this instance
// are on it (upstream.Health.CutBackoff).
func (a *call) cutAfterBytes() { a.failed(a.st.Slots.InFlight() > 1) }

func (a *call) failed(others bool) {
	now := time.Now()
	if d := a.st.Health.CutBackoff(now, a.pol.EjectBase, a.pol.EjectMax, others); d > 0 {
		a.st.MarkOut(upstream.OutEjected)
		a.f.Ejection(a.d.GetId(), "failures")
		a.f.Log.Warn("deployment ejected after consecutive failures", "deployment", a.d.GetId(),
			"model_group", a.d.GetModelGroup(), "ejected_for_ms", d.Milliseconds())
	}
}

// transportFailure classifies an error of client.Do.
func (a *call) transportFailure(ctx, clientCtx context.Context, err error) Outcome {
	switch {
	case clientCtx.Err() != nil:
		return Outcome{Err: openai.ClientClosed()}
	case ctx.Err() != nil:
		if errors.Is(context.Cause(ctx), a.f.LeaseLost) {
			return Outcome{Err: openai.Unavailable(openai.CodeLimitsUnavailable, a.f.LeaseLost.Error(), time.Second)}
		}
		a.f.UpstreamError(a.d.GetId(), "timeout")
		if errors.Is(context.Cause(ctx), errTTFT) {
			return Outcome{Err: a.ttftTimeout(), Retry: true}
		}
		return Outcome{Err: timeout(a.f.RequestTimeout)}
	}
	var op *net.OpError
	kind := "transport"
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		kind = "refused"
	case errors.As(err, &op) && op.Op == "dial":
		kind = "connect"
	}
	a.f.UpstreamError(a.d.GetId(), kind)
	a.unhealthy()
	a.f.Log.Warn("upstream request failed", "request_id", a.x.RequestID(), "deployment", a.d.GetId(), "kind", kind, "error", err)
	switch kind {
	case "refused":
		return Outcome{Err: openai.UpstreamFailed("the model server refused the connection"), Retry: true}
	case "connect":
		return Outcome{Err: openai.UpstreamFailed("the model server could not be reached"), Retry: true}
	}
	// The request may have reached the engine: not retried.
	return Outcome{Err: openai.UpstreamFailed("the connection to the model server failed")}
}

// timeout is the answer at the request's total deadline: not retried (by
// the proxy: the time is up) and retrying the same request cannot help.
func timeout(d time.Duration) *openai.Error {
	return openai.UpstreamTimeout(fmt.Sprintf("the request did not complete within its deadline of %s", d), false)
}

func (a *call) ttftTimeout() *openai.Error {
	return openai.UpstreamTimeout(fmt.Sprintf("the model server sent no first token within the TTFT deadline of %s", a.pol.TTFTTimeout), true)
}

// retryAfter reads Retry-After (seconds; HTTP dates are not used by
// engines) or Retry-After-Ms.
func retryAfter(hd http.Header) time.Duration {
	if v := hd.Get("Retry-After-Ms"); v != "" {
		if ms, err := strconv.ParseFloat(v, 64); err == nil && ms > 0 {
			return time.Duration(ms * float64(time.Millisecond))
		}
	}
	if v := hd.Get("Retry-After"); v != "" {
		if s, err := strconv.ParseFloat(v, 64); err == nil && s > 0 {
			return time.Duration(s * float64(time.Second))
		}
	}
	return 0
}

// readFailure maps an error reading the upstream answer.
func (a *call) readFailure(ctx, clientCtx context.Context, err error) *openai.Error {
	switch {
	case clientCtx.Err() != nil:
		return openai.ClientClosed()
	case ctx.Err() != nil:
		if errors.Is(context.Cause(ctx), a.f.LeaseLost) {
			return openai.Unavailable(openai.CodeLimitsUnavailable, a.f.LeaseLost.Error(), time.Second)
		}
		a.f.UpstreamError(a.d.GetId(), "timeout")
		if errors.Is(context.Cause(ctx), errTTFT) {
			return a.ttftTimeout()
		}
		return timeout(a.f.RequestTimeout)
	}
	a.f.UpstreamError(a.d.GetId(), "transport")
	return openai.UpstreamFailed("the model server broke off its answer")
}

// respBufs are the buffers non-streaming answers are read into (returned
// once written to the client; very large ones are left to the GC).
var respBufs = sync.Pool{New: func() any { return new(bytes.Buffer) }}

const maxPooledResp = 1 << 20

// relayBody relays a complete (non-streaming) answer, reading its usage.
func (a *call) relayBody(ctx, clientCtx context.Context, w http.ResponseWriter, resp *http.Response) Outcome {
	defer resp.Body.Close()
	a.x.Relaying(false)
	buf := respBufs.Get().(*bytes.Buffer)
	buf.Reset()
	defer func() {
		if buf.Cap() <= maxPooledResp {
			respBufs.Put(buf)
		}
	}()
	if n := resp.ContentLength; n > 0 && n <= maxResponseBytes {
		buf.Grow(int(n) + bytes.MinRead)
	}
	_, err := buf.ReadFrom(io.LimitReader(resp.Body, maxResponseBytes+1))
	if err != nil {
		return Outcome{Err: a.readFailure(ctx, clientCtx, err)}
	}
	b := buf.Bytes()
	if len(b) > maxResponseBytes {
		a.f.UpstreamError(a.d.GetId(), "transport")
		return Outcome{Err: openai.UpstreamFailed(fmt.Sprintf("the upstream answer exceeds %d bytes", maxResponseBytes))}
	}
	if u := a.wire.bodyUsage(b); u != nil {
		a.x.Usage(u)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "" {
		w.Header().Set("Content-Type", ct)
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(resp.StatusCode)
	a.x.SetStatus(resp.StatusCode)
	if _, err := w.Write(b); err != nil {
		a.x.SetResult(openai.StatusClientClosed, openai.CodeClientClosed)
	}
	return Outcome{}
}

// relayStream relays an SSE answer event by event, flushing after each so
// nothing waits in a buffer. The usage chunk (always requested upstream) is
// read and stripped unless the client asked for it. The 200 headers go out
// with the first relayed event: until then a failure (a cut, the TTFT
// deadline) is retryable, since nothing reached the client. Once they are
// out, failures are reported in the stream as an error event.
//
// A held stream (a half-open deployment's probe, Policy.Probe, or a stream
// to a deployment on stream probation, Policy.Probation) keeps its events
// back until it ends, its deployment is proven by another stream, or the
// hold's bounds pass (ProbeHoldMax, ProbeHoldBytes): a cut within the
// hold is retryable like one before the first event. A clean end, or a
// stream outliving the hold, proves the deployment; a cut puts it back on
// probation.
func (a *call) relayStream(ctx, clientCtx context.Context, w http.ResponseWriter, resp *http.Response) Outcome {
	defer resp.Body.Close()
	rc := http.NewResponseController(w)
	ct := resp.Header.Get("Content-Type")
	er := openai.NewEventReader(resp.Body)
	sawDone, sawError := false, false
	// mu orders the relay's state and its writes to the client between
	// this goroutine and a held stream's watcher (hold.watch), which
	// releases the hold while this one waits for the next event.
	var mu sync.Mutex
	hd := a.newHold()
	defer hd.stop()
	// write relays b (events), the 200 headers first; false when the
	// client is gone.
	write := func(b []byte, text int) bool {
		if !a.wrote.Load() {
			hd := w.Header()
			hd.Set("Content-Type", ct)
			hd.Set("Cache-Control", "no-cache")
			hd.Set("X-Accel-Buffering", "no")
			w.WriteHeader(http.StatusOK)
			a.wrote.Store(true)
			a.x.SetStatus(http.StatusOK)
			a.x.Relaying(true)
		}
		for range text {
			a.x.ContentChunk()
		}
		if _, werr := w.Write(b); werr != nil {
			a.x.SetResult(openai.StatusClientClosed, openai.CodeClientClosed)
			return false
		}
		a.x.FirstByte()
		if ferr := rc.Flush(); ferr != nil {
			a.x.SetResult(openai.StatusClientClosed, openai.CodeClientClosed)
			return false
		}
		return true
	}
	// release ends the hold (mu held): its events go to the client.
	release := func(outcome string) bool {
		a.endHold(hd, outcome)
		if outcome == HoldBounds {
			a.prove() // it outlived what a hold can protect
		}
		if hd.buf.Len() > 0 && !write(hd.buf.Bytes(), hd.text) {
			hd.gone = true
			return false
		}
		return true
	}
	// step handles one read of the upstream (mu held); end says the
	// attempt is over with out.
	step := func(ev []byte, err error) (out Outcome, end bool) {
		if hd.gone {
			return Outcome{}, true // the watcher's release found the client gone
		}
		if ev != nil {
			keep, done, text, isErr := a.inspect(ev)
			sawDone = sawDone || done
			sawError = sawError || isErr
			switch {
			case !hd.on:
				if text {
					a.x.ContentChunk()
				}
				if keep {
					a.firstEvent()
					if !write(ev, 0) {
						return Outcome{}, true
					}
				}
			default:
				if text {
					hd.text++
				}
				if keep {
					a.firstEvent()
					hd.buf.Write(ev)
					if hd.start.IsZero() {
						hd.start = time.Now()
						hd.watch(&mu, release)
					}
				}
				var ok bool
				switch {
				case done:
					ok = release(HoldDone)
				case hd.buf.Len() >= ProbeHoldBytes || (!hd.start.IsZero() && time.Since(hd.start) >= ProbeHoldMax):
					ok = release(HoldBounds)
				default:
					ok = true
				}
				if !ok {
					return Outcome{}, true
				}
			}
		}
		if err == nil {
			return Outcome{}, false
		}
		if errors.Is(err, io.EOF) && sawDone {
			a.st.Health.Succeeded() // a probe's hold ended at its [DONE] event
			if !sawError {
				a.prove()
			}
			return Outcome{}, true
		}
		if sawDone && !hd.on && clientCtx.Err() != nil {
			// [DONE] reached the client, which then left before the
			// upstream ended its response (the OpenAI SDKs stop reading
			// and close the connection at [DONE]): the answer was whole,
			// and the request is the 200 it was, not a client that left.
			a.st.Health.Succeeded()
			if !sawError {
				a.prove()
			}
			return Outcome{}, true
		}
		var e *openai.Error
		if errors.Is(err, io.EOF) {
			a.f.UpstreamError(a.d.GetId(), "stream")
			a.cut()
			e = openai.Upstream(openai.CodeUpstreamStreamError, "the upstream model server ended the stream early")
		} else {
			e = a.readFailure(ctx, clientCtx, err)
			if e.Code == openai.CodeUpstreamError {
				a.cut()
			}
		}
		heldCut := false
		if hd.on {
			if e.Code == openai.CodeUpstreamStreamError || e.Code == openai.CodeUpstreamError {
				heldCut = !hd.start.IsZero() // its first event was held: the hold caught the cut
				a.endHold(hd, HoldCut)
			} else {
				a.endHold(hd, HoldAborted)
			}
		}
		if e.Status == openai.StatusClientClosed {
			a.x.SetResult(openai.StatusClientClosed, openai.CodeClientClosed)
			return Outcome{}, true
		}
		if !a.wrote.Load() {
			// Nothing reached the client: a cut, or the TTFT deadline,
			// before the first event (or within a hold). Another
			// deployment may serve it (never after the total deadline:
			// the time is up).
			a.x.UpstreamAnswered(false)
			retry := ctx.Err() == nil || errors.Is(context.Cause(ctx), errTTFT)
			if e.Code == openai.CodeUpstreamStreamError {
				e = openai.UpstreamFailed("the model server ended the stream before its first token")
			}
			if hd.buf.Len() > 0 {
				// The held events never reached the client: the retry's
				// answer is the request's (its error code too).
				a.x.SetErrorCode("")
				if e.Code == openai.CodeUpstreamError {
					e = openai.UpstreamFailed("the model server ended the stream early (nothing had reached the client)")
				}
			}
			return Outcome{Err: e, Retry: retry, HoldCut: heldCut && retry}, true
		}
		// Headers are out: tell the client in the stream.
		a.x.SetErrorCode(e.Code)
		_, _ = w.Write(a.wire.errorEvent(e))
		_ = rc.Flush()
		return Outcome{}, true
	}
	for {
		ev, err := er.Next()
		mu.Lock()
		out, end := step(ev, err)
		mu.Unlock()
		if end {
			return out
		}
	}
}

// cut records a stream cut (before or after bytes reached the client):
// it counts against the deployment and puts it back on probation.
func (a *call) cut() {
	if a.pol.Probation && a.st.Health.Probation.Revoke() {
		a.f.probation(a.d.GetId(), "revoked")
	}
	if a.wrote.Load() {
		a.cutAfterBytes()
	} else {
		a.unhealthy() // a stream cut counts against the deployment
	}
}

// prove ends the deployment's stream probation (a clean end, or a stream
// outliving its hold), releasing the streams held on it.
func (a *call) prove() {
	if a.pol.Probation && a.st.Health.Probation.Prove() {
		a.f.probation(a.d.GetId(), "proven")
	}
}

// firstEvent records the stream's first event from the engine (relayed or
// held): its TTFT deadline has passed, its prefill is over.
func (a *call) firstEvent() {
	if !a.started.Swap(true) {
		a.x.FirstEvent()
	}
}

// Held-stream outcomes (Exchange.StreamHold, Forwarder.Hold): the stream
// ended ([DONE]) within the hold (relayed whole), the deployment was
// proven by another stream, the hold's bounds passed, the engine cut the
// stream within the hold (nothing reached the client: retried when the
// budget allows), the attempt ended otherwise (the client left, a
// deadline).
const (
	HoldDone     = "done"
	HoldReleased = "released"
	HoldBounds   = "bounds"
	HoldCut      = "cut"
	HoldAborted  = "aborted"
)

// Hold reasons: a half-open deployment's probe, a deployment on stream
// probation.
const (
	HoldProbe     = "probe"
	HoldProbation = "probation"
)

// hold is a stream held back from its client (relayStream). Its fields
// are guarded by relayStream's mu once the watcher runs.
type hold struct {
	on     bool   // still holding
	reason string // HoldProbe, HoldProbation
	// released is closed when the deployment is proven by another
	// stream (probation only; nil: never).
	released <-chan struct{}
	buf      bytes.Buffer
	text     int       // held content chunks
	start    time.Time // the first held event
	gone     bool      // a release by the watcher found the client gone
	done     chan struct{}
	wg       sync.WaitGroup
}

// newHold says whether the stream is held: a probe's, or one to a
// deployment on probation (with the probation on).
func (a *call) newHold() *hold {
	hd := &hold{}
	if a.pol.Probation {
		if on, ch := a.st.Health.Probation.OnProbation(); on {
			hd.on, hd.reason, hd.released = true, HoldProbation, ch
		}
	}
	if a.pol.Probe {
		hd.on, hd.reason = true, HoldProbe
	}
	return hd
}

// watch starts the watcher of a hold whose first event is held (mu
// held): it releases the hold when the deployment is proven by another
// stream or ProbeHoldMax passes, while relayStream waits for the next
// event (an engine stalling mid-hold delays nobody past the bound).
func (hd *hold) watch(mu *sync.Mutex, release func(string) bool) {
	hd.done = make(chan struct{})
	hd.wg.Add(1)
	go func() {
		defer hd.wg.Done()
		t := time.NewTimer(ProbeHoldMax - time.Since(hd.start))
		defer t.Stop()
		outcome := HoldBounds
		select {
		case <-hd.done:
			return
		case <-hd.released:
			outcome = HoldReleased
		case <-t.C:
		}
		mu.Lock()
		defer mu.Unlock()
		if hd.on {
			release(outcome)
		}
	}()
}

// stop ends the watcher (relayStream's exit, mu not held).
func (hd *hold) stop() {
	if hd.done != nil {
		close(hd.done)
		hd.wg.Wait()
	}
}

// endHold records the end of a hold whose first event was held (mu
// held); a hold that held nothing is not counted.
func (a *call) endHold(hd *hold, outcome string) {
	if !hd.on {
		return
	}
	hd.on = false
	if hd.start.IsZero() {
		return
	}
	held := time.Since(hd.start)
	a.x.StreamHold(hd.reason, outcome, held)
	if a.f.Hold != nil {
		a.f.Hold(a.d.GetId(), hd.reason, outcome)
	}
}

// inspect reads one SSE event: it records usage and says whether to relay
// it (the usage-only chunk is dropped unless the client asked for it),
// whether it is the [DONE] marker, whether it carries text (a content
// chunk, counted by the caller as it is relayed) and whether it is the
// engine's error event.
func (a *call) inspect(ev []byte) (keep, done, text, isErr bool) {
	e := a.wire.event(ev)
	if e.Usage != nil { // before Done: a Responses stream's terminal event carries it
		a.x.Usage(e.Usage)
	}
	switch {
	case e.Done:
		return true, true, false, false
	case e.Error:
		a.x.SetErrorCode(openai.CodeUpstreamStreamError)
		a.f.UpstreamError(a.d.GetId(), "stream")
		return true, false, false, true
	}
	return e.Keep(a.x.Request().IncludeUsage()), false, e.Text, false
}

// Engine 4xx answers (other than 429) become typed Sluice errors in the
// OpenAI shape (docs/errors.md):
//
//   - 401/403: the engine refused the deployment's credential. The client
//     gets 502 upstream_auth_failed (never a 401/403, which would say its
//     own key is wrong); the operator a warning log line (deployment, no
//     credential) and sluice_proxy_upstream_errors_total{kind="auth"}.
//   - 404/405: the engine does not serve the deployment's model or route, a
//     deployment misconfiguration the client cannot fix: 502
//     upstream_error, logged and counted as kind="not_found".
//   - any other 4xx (400, 422, 413, …): the engine's verdict on the
//     request: invalid_request_error upstream_bad_request with the
//     engine's status (422 becomes 400, as OpenAI answers validation
//     errors), its param when it names one, and its message, sanitised.

// maxEngineMessage bounds the engine's message relayed to the client.
const maxEngineMessage = 1024

// upstreamRejected answers an engine 4xx other than 429.
func (a *call) upstreamRejected(ctx, clientCtx context.Context, resp *http.Response) Outcome {
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return Outcome{Err: a.readFailure(ctx, clientCtx, err)}
	}
	d, s := a.d, resp.StatusCode
	switch s {
	case http.StatusUnauthorized, http.StatusForbidden:
		a.f.UpstreamError(d.GetId(), "auth")
		a.f.Log.Warn("the upstream refused the deployment's credential", "request_id", a.x.RequestID(), "deployment", d.GetId(),
			"model_group", d.GetModelGroup(), "status", s, "credential_set", d.Credential != "")
		return Outcome{Err: &openai.Error{Status: http.StatusBadGateway, Type: openai.TypeUpstream, Code: openai.CodeUpstreamAuthFailed,
			Message: fmt.Sprintf("the model server refused the gateway's credential for this deployment (HTTP %d); "+
				"your API key is not the problem: the operator must fix the deployment's credential", s)}}
	case http.StatusNotFound, http.StatusMethodNotAllowed:
		a.f.UpstreamError(d.GetId(), "not_found")
		a.f.Log.Warn("the upstream does not serve the deployment's model or route", "request_id", a.x.RequestID(), "deployment", d.GetId(),
			"model_group", d.GetModelGroup(), "upstream_model", d.GetUpstreamModel(), "route", a.x.Route(), "status", s)
		return Outcome{Err: &openai.Error{Status: http.StatusBadGateway, Type: openai.TypeUpstream, Code: openai.CodeUpstreamError,
			Message: fmt.Sprintf("the model server does not serve this deployment's model or route (HTTP %d); the operator must fix the deployment", s)}}
	}
	msg, param := openai.EngineMessage(b)
	msg = safeEngineText(msg, d)
	if msg == "" {
		msg = fmt.Sprintf("the model server rejected the request (HTTP %d)", s)
	} else {
		msg = "the model server rejected the request: " + msg
	}
	return Outcome{Err: openai.UpstreamBadRequest(s, param, msg)}
}

// safeEngineText makes an engine's message fit for the client: the
// deployment's credential and address are removed, control characters
// become spaces, invalid UTF-8 is replaced, and it is cut at
// maxEngineMessage bytes.
func safeEngineText(msg string, d *catalog.Deployment) string {
	if msg == "" {
		return ""
	}
	if cred := d.Credential; len(cred) >= 4 {
		msg = strings.ReplaceAll(msg, cred, "[redacted]")
	}
	if base := d.GetApiBase(); base != "" {
		msg = strings.ReplaceAll(msg, strings.TrimSuffix(base, "/"), "[model server]")
		if u, err := url.Parse(base); err == nil && u.Host != "" {
			msg = strings.ReplaceAll(msg, u.Host, "[model server]")
		}
	}
	msg = strings.ToValidUTF8(msg, "\uFFFD")
	msg = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, msg)
	msg = strings.TrimSpace(msg)
	if len(msg) > maxEngineMessage {
		cut := maxEngineMessage
		for cut > 0 && !utf8.RuneStart(msg[cut]) {
			cut--
		}
		msg = msg[:cut] + "…"
	}
	return msg
}

// drain discards the rest of an upstream body (bounded) so its connection
// can be reused.
func drain(rc io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(rc, 64<<10))
	_ = rc.Close()
}
