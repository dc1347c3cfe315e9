package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// outcome is the result of one upstream attempt.
type outcome struct {
	// err is the answer when the attempt failed (nil: the client got its
	// answer).
	err *Error
	// retry says another deployment may be tried: nothing reached the
	// client and the failure is retryable.
	retry bool
}

// forward tries the candidates in order: one attempt per deployment, at
// most 1+retries attempts, within ctx's total deadline. clientCtx is the
// client's own context (to tell a disconnect from the deadline).
func (x *exchange) forward(ctx, clientCtx context.Context, w http.ResponseWriter, cands []candidate) *Error {
	h := x.h
	var last *Error
	next := 0
	var wait time.Duration // shortest retry-after of a deployment at its cap
	recovering := false    // a deployment's lease count is in quarantine
	for x.attempts <= h.retries {
		var c *candidate
		for ; next < len(cands) && c == nil; next++ {
			cand := &cands[next]
			if !cand.st.tryAcquire(cand.d.GetMaxConcurrency()) {
				continue
			}
			// The fleet-wide max_concurrency lease (Redis), after the
			// per-instance one.
			dl, rej, e := x.admitDeployment(ctx, cand.d)
			switch {
			case e != nil:
				cand.st.release()
				return e
			case rej != nil:
				cand.st.release()
				if wait == 0 || rej.RetryAfter < wait {
					wait = rej.RetryAfter
				}
				recovering = recovering || rej.Quarantined
				continue
			}
			if dl != nil {
				x.leases.setDep(dl)
				x.startRenewal()
			}
			c = cand
		}
		if c == nil {
			if last != nil {
				return last
			}
			if recovering {
				return unavailable(CodeLimitsRecovering, "the limits store restarted moments ago; deployment concurrency is re-counted, retry shortly", max(wait, 100*time.Millisecond))
			}
			return unavailable(CodeOverloaded, fmt.Sprintf("every deployment of model %q is at its concurrency limit", x.group), max(wait, time.Second))
		}
		if x.attempts > 0 {
			h.series.group(x.group).retries.Inc()
		}
		x.attempts++
		x.dep = c.d
		out := x.attemptHeld(ctx, clientCtx, w, c)
		if out.err == nil {
			return nil
		}
		if !out.retry {
			return out.err
		}
		last = out.err
	}
	return last
}

// attemptHeld runs one attempt on c and releases what the attempt holds
// (the per-instance slot, the in-flight gauge, the deployment lease) on
// every exit, panics included.
func (x *exchange) attemptHeld(ctx, clientCtx context.Context, w http.ResponseWriter, c *candidate) outcome {
	g := x.h.series.upstreamInFlight(c.d.GetId())
	g.Inc()
	defer func() {
		g.Dec()
		c.st.release()
		x.releaseDeploymentLease()
	}()
	return x.attempt(ctx, clientCtx, w, c)
}

// upstreamURL joins a deployment's api_base (".../v1") and a route.
func upstreamURL(apiBase, route string) string {
	return strings.TrimSuffix(apiBase, "/") + strings.TrimPrefix(route, "/v1")
}

func (x *exchange) attempt(ctx, clientCtx context.Context, w http.ResponseWriter, c *candidate) outcome {
	h := x.h
	d := c.d
	body := x.req.rewrite(d.GetUpstreamModel())
	ureq, err := http.NewRequestWithContext(ctx, http.MethodPost, upstreamURL(d.GetApiBase(), x.route), bytes.NewReader(body))
	if err != nil {
		h.log.Error("bad upstream URL", "deployment", d.GetId(), "error", err)
		return outcome{err: &Error{Status: http.StatusBadGateway, Type: TypeUpstream, Code: CodeUpstreamError,
			Message: "the deployment's upstream address is invalid"}, retry: true}
	}
	ureq.Header.Set("Content-Type", "application/json")
	ureq.Header.Set("X-Request-Id", x.id)
	if d.Credential != "" {
		ureq.Header.Set("Authorization", "Bearer "+d.Credential)
	}
	resp, err := h.client.Do(ureq)
	if err != nil {
		return x.transportFailure(ctx, clientCtx, c, err)
	}
	x.upstreamAnswered = true
	switch s := resp.StatusCode; {
	case s >= 200 && s < 300:
		c.st.succeeded()
		if x.req.stream && strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
			return x.relayStream(ctx, clientCtx, w, resp)
		}
		return x.relayBody(ctx, clientCtx, w, resp)
	case s == http.StatusBadGateway || s == http.StatusServiceUnavailable || s == http.StatusGatewayTimeout:
		x.upstreamAnswered = false // nothing generated: charge nothing
		ra := retryAfter(resp.Header)
		drain(resp.Body)
		h.m.upstreamErrors.WithLabelValues(d.GetId(), "status_5xx").Inc()
		x.unhealthy(c, ra)
		e := &Error{Status: http.StatusBadGateway, Type: TypeUpstream, Code: CodeUpstreamError,
			Message: fmt.Sprintf("the upstream model server failed (HTTP %d)", s)}
		if s == http.StatusServiceUnavailable {
			e = unavailable(CodeUpstreamUnavailable, "the upstream model server is unavailable (HTTP 503)", max(ra, time.Second))
		}
		return outcome{err: e, retry: true}
	case s >= 500:
		x.upstreamAnswered = false
		drain(resp.Body)
		h.m.upstreamErrors.WithLabelValues(d.GetId(), "status_5xx").Inc()
		x.unhealthy(c, 0)
		return outcome{err: &Error{Status: http.StatusBadGateway, Type: TypeUpstream, Code: CodeUpstreamError,
			Message: fmt.Sprintf("the upstream model server failed (HTTP %d)", s)}}
	default:
		// A 4xx is the upstream's verdict on the request: pass it through.
		x.upstreamAnswered = false
		if s == http.StatusTooManyRequests {
			h.m.upstreamErrors.WithLabelValues(d.GetId(), "status_429").Inc()
			if ra := retryAfter(resp.Header); ra > 0 {
				c.st.park(time.Now(), ra)
				h.m.ejections.WithLabelValues(d.GetId(), "parked").Inc()
			}
		}
		return x.passThrough(ctx, clientCtx, w, resp)
	}
}

// unhealthy records a connect failure or 5xx (parking the deployment
// when it sent a Retry-After).
func (x *exchange) unhealthy(c *candidate, ra time.Duration) {
	now := time.Now()
	if ra > 0 {
		c.st.park(now, ra)
		x.h.m.ejections.WithLabelValues(c.d.GetId(), "parked").Inc()
	}
	if d := c.st.failed(now); d > 0 {
		x.h.m.ejections.WithLabelValues(c.d.GetId(), "failures").Inc()
		x.h.log.Warn("deployment ejected after consecutive failures", "deployment", c.d.GetId(),
			"model_group", c.d.GetModelGroup(), "ejected_for_ms", d.Milliseconds())
	}
}

// transportFailure classifies an error of client.Do.
func (x *exchange) transportFailure(ctx, clientCtx context.Context, c *candidate, err error) outcome {
	switch {
	case clientCtx.Err() != nil:
		return outcome{err: clientClosed()}
	case ctx.Err() != nil:
		if errors.Is(context.Cause(ctx), errLeaseLost) {
			return outcome{err: limitsUnavailable(errLeaseLost.Error())}
		}
		x.h.m.upstreamErrors.WithLabelValues(c.d.GetId(), "timeout").Inc()
		return outcome{err: timeout(x.h.cfg.RequestTimeout)}
	}
	var op *net.OpError
	kind := "transport"
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		kind = "refused"
	case errors.As(err, &op) && op.Op == "dial":
		kind = "connect"
	}
	x.h.m.upstreamErrors.WithLabelValues(c.d.GetId(), kind).Inc()
	x.unhealthy(c, 0)
	x.h.log.Warn("upstream request failed", "request_id", x.id, "deployment", c.d.GetId(), "kind", kind, "error", err)
	switch kind {
	case "refused":
		return outcome{err: unavailable(CodeUpstreamUnavailable, "the upstream model server refused the connection", time.Second), retry: true}
	case "connect":
		return outcome{err: &Error{Status: http.StatusBadGateway, Type: TypeUpstream, Code: CodeUpstreamError,
			Message: "the upstream model server could not be reached"}, retry: true}
	}
	// The request may have reached the engine: not retried.
	return outcome{err: &Error{Status: http.StatusBadGateway, Type: TypeUpstream, Code: CodeUpstreamError,
		Message: "the connection to the upstream model server failed"}}
}

func clientClosed() *Error {
	return &Error{Status: StatusClientClosed, Type: TypeInvalidRequest, Code: CodeClientClosed, Message: "the client closed the request"}
}

func timeout(d time.Duration) *Error {
	return &Error{Status: http.StatusGatewayTimeout, Type: TypeTimeout, Code: CodeUpstreamTimeout, NoRetry: true,
		Message: fmt.Sprintf("the request did not complete within its deadline of %s", d)}
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

// usageFields is OpenAI's usage object.
type usageFields struct {
	PromptTokens        int64 `json:"prompt_tokens"`
	CompletionTokens    int64 `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (x *exchange) setUsage(u *usageFields) {
	x.usageSeen = true
	x.prompt, x.completion = u.PromptTokens, u.CompletionTokens
	if u.PromptTokensDetails != nil {
		x.cached = u.PromptTokensDetails.CachedTokens
	}
}

// readFailure maps an error reading the upstream answer.
func (x *exchange) readFailure(ctx, clientCtx context.Context, err error) *Error {
	switch {
	case clientCtx.Err() != nil:
		return clientClosed()
	case ctx.Err() != nil:
		if errors.Is(context.Cause(ctx), errLeaseLost) {
			return limitsUnavailable(errLeaseLost.Error())
		}
		x.h.m.upstreamErrors.WithLabelValues(x.dep.GetId(), "timeout").Inc()
		return timeout(x.h.cfg.RequestTimeout)
	}
	x.h.m.upstreamErrors.WithLabelValues(x.dep.GetId(), "transport").Inc()
	return &Error{Status: http.StatusBadGateway, Type: TypeUpstream, Code: CodeUpstreamError,
		Message: "the upstream model server broke off its answer"}
}

// respBufs are the buffers non-streaming answers are read into (returned
// once written to the client; very large ones are left to the GC).
var respBufs = sync.Pool{New: func() any { return new(bytes.Buffer) }}

const maxPooledResp = 1 << 20

// relayBody relays a complete (non-streaming) answer, reading its usage.
func (x *exchange) relayBody(ctx, clientCtx context.Context, w http.ResponseWriter, resp *http.Response) outcome {
	defer resp.Body.Close()
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
		return outcome{err: x.readFailure(ctx, clientCtx, err)}
	}
	b := buf.Bytes()
	if len(b) > maxResponseBytes {
		x.h.m.upstreamErrors.WithLabelValues(x.dep.GetId(), "transport").Inc()
		return outcome{err: &Error{Status: http.StatusBadGateway, Type: TypeUpstream, Code: CodeUpstreamError,
			Message: fmt.Sprintf("the upstream answer exceeds %d bytes", maxResponseBytes)}}
	}
	if json.Valid(b) {
		if v := memberValue(b, "usage"); !isNull(v) {
			var u usageFields
			if json.Unmarshal(v, &u) == nil {
				x.setUsage(&u)
			}
		}
	}
	if ct := resp.Header.Get("Content-Type"); ct != "" {
		w.Header().Set("Content-Type", ct)
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(resp.StatusCode)
	x.status = resp.StatusCode
	if _, err := w.Write(b); err != nil {
		x.status, x.errCode = StatusClientClosed, CodeClientClosed
	}
	return outcome{}
}

// passThrough relays an upstream 4xx with its body.
func (x *exchange) passThrough(ctx, clientCtx context.Context, w http.ResponseWriter, resp *http.Response) outcome {
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return outcome{err: x.readFailure(ctx, clientCtx, err)}
	}
	for _, k := range []string{"Content-Type", "Retry-After", "Retry-After-Ms"} {
		if v := resp.Header.Get(k); v != "" {
			w.Header().Set(k, v)
		}
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(b)
	x.status, x.errCode = resp.StatusCode, CodeUpstreamClientError
	return outcome{}
}

var (
	dataPrefix  = []byte("data:")
	doneMarker  = []byte("[DONE]")
	usageKey    = []byte(`"usage"`)
	errorPrefix = []byte(`{"error"`)
)

// relayStream relays an SSE answer event by event, flushing after each so
// nothing waits in a buffer. The usage chunk (always requested upstream) is
// read and stripped unless the client asked for it. Once the headers are
// sent, failures are reported in the stream as an error event.
func (x *exchange) relayStream(ctx, clientCtx context.Context, w http.ResponseWriter, resp *http.Response) outcome {
	defer resp.Body.Close()
	rc := http.NewResponseController(w)
	hd := w.Header()
	hd.Set("Content-Type", resp.Header.Get("Content-Type"))
	hd.Set("Cache-Control", "no-cache")
	hd.Set("X-Accel-Buffering", "no")
	// The headers go out with the first relayed event (one write, as a
	// flushing reverse proxy does), not in a write of their own.
	w.WriteHeader(http.StatusOK)
	x.status = http.StatusOK
	br := bufio.NewReaderSize(resp.Body, 16<<10)
	var ev []byte
	sawDone, partial := false, false
	for {
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			ev = append(ev, line...)
			partial = true
			continue
		}
		ev = append(ev, line...)
		blank := !partial && len(line) > 0 && (line[0] == '\n' || line[0] == '\r')
		partial = false
		// An event ends at a blank line (or at the end of the body).
		if blank || (err != nil && len(ev) > 0) {
			keep, done := x.inspect(ev)
			sawDone = sawDone || done
			if keep {
				if _, werr := w.Write(ev); werr != nil {
					x.status, x.errCode = StatusClientClosed, CodeClientClosed
					return outcome{}
				}
				if x.ttft == 0 {
					x.ttft = time.Since(x.start)
				}
				if ferr := rc.Flush(); ferr != nil {
					x.status, x.errCode = StatusClientClosed, CodeClientClosed
					return outcome{}
				}
			}
			ev = ev[:0]
		}
		if err != nil {
			if err == io.EOF && sawDone {
				return outcome{}
			}
			var e *Error
			if err == io.EOF {
				x.h.m.upstreamErrors.WithLabelValues(x.dep.GetId(), "stream").Inc()
				e = &Error{Status: http.StatusBadGateway, Type: TypeUpstream, Code: CodeUpstreamStreamError,
					Message: "the upstream model server ended the stream early"}
			} else {
				e = x.readFailure(ctx, clientCtx, err)
			}
			if e.Status == StatusClientClosed {
				x.status, x.errCode = StatusClientClosed, CodeClientClosed
				return outcome{}
			}
			// Headers are out: tell the client in the stream.
			x.errCode = e.Code
			_, _ = fmt.Fprintf(w, "data: %s\n\n", e.body())
			_ = rc.Flush()
			return outcome{}
		}
	}
}

// inspect reads one SSE event: it records usage, counts content chunks and
// says whether to relay it (the usage-only chunk is dropped unless the
// client asked for it) and whether it is the [DONE] marker.
func (x *exchange) inspect(ev []byte) (keep, done bool) {
	payload := ssePayload(ev)
	if payload == nil {
		return true, false
	}
	if bytes.Equal(payload, doneMarker) {
		return true, true
	}
	if bytes.HasPrefix(payload, errorPrefix) {
		x.errCode = CodeUpstreamStreamError
		x.h.m.upstreamErrors.WithLabelValues(x.dep.GetId(), "stream").Inc()
		return true, false
	}
	if i := bytes.Index(payload, usageKey); i >= 0 {
		j := skipWS(payload, i+len(usageKey))
		if j < len(payload) && payload[j] == ':' {
			j = skipWS(payload, j+1)
		}
		if j < len(payload) && payload[j] == '{' {
			var chunk struct {
				Choices []json.RawMessage `json:"choices"`
				Usage   *usageFields      `json:"usage"`
			}
			if json.Unmarshal(payload, &chunk) == nil && chunk.Usage != nil {
				x.setUsage(chunk.Usage)
				if len(chunk.Choices) == 0 {
					return x.req.includeUsage, false
				}
			}
		}
	}
	if hasText(payload) {
		x.contentChunks++
	}
	return true, false
}

var (
	contentKey      = []byte(`"content":"`)
	emptyContentKey = []byte(`"content":""`)
	textKey         = []byte(`"text":"`)
	emptyTextKey    = []byte(`"text":""`)
)

// hasText reports whether a chunk carries generated text (chat delta
// content or completion text), compactly encoded as engines send it.
func hasText(p []byte) bool {
	return bytes.Contains(p, contentKey) && !bytes.Contains(p, emptyContentKey) ||
		bytes.Contains(p, textKey) && !bytes.Contains(p, emptyTextKey)
}

// ssePayload returns the data of an event (its data lines joined), nil for
// an event without data.
func ssePayload(ev []byte) []byte {
	var out []byte
	n := 0
	for len(ev) > 0 {
		line := ev
		if i := bytes.IndexByte(ev, '\n'); i >= 0 {
			line, ev = ev[:i], ev[i+1:]
		} else {
			ev = nil
		}
		line = bytes.TrimSuffix(line, []byte{'\r'})
		v, ok := bytes.CutPrefix(line, dataPrefix)
		if !ok {
			continue
		}
		v = bytes.TrimPrefix(v, []byte{' '})
		if n == 0 {
			out = v
		} else {
			out = append(append(append([]byte(nil), out...), '\n'), v...)
		}
		n++
	}
	return out
}
