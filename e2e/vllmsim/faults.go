package vllmsim

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Per-request fault-injection headers. They apply to /v1 routes, on top of
// (and overriding) the server's Faults.
const (
	// HeaderFaultStatus answers the request with this HTTP status.
	HeaderFaultStatus = "X-Sim-Fault-Status"
	// HeaderFaultRetryAfter sets Retry-After of a 429/503 fault (seconds, or
	// a Go duration such as "1500ms", rounded up to whole seconds).
	HeaderFaultRetryAfter = "X-Sim-Fault-Retry-After"
	// HeaderFaultDelay delays the request (wall-clock; milliseconds, or a Go
	// duration such as "2s").
	HeaderFaultDelay = "X-Sim-Fault-Delay"
	// HeaderFaultCutAfter drops the connection after this many SSE chunks
	// (0: right after the response headers). A non-streaming request with
	// this header never gets its answer: the connection drops instead.
	HeaderFaultCutAfter = "X-Sim-Fault-Cut-After"
	// HeaderFaultRefuseFor drops this request's connection and refuses new
	// connections for this long (a Go duration; wall-clock), as a crashed
	// and restarting engine would.
	HeaderFaultRefuseFor = "X-Sim-Fault-Refuse-For"
	// HeaderOutputTokens makes the model stop (finish reason "stop") after
	// exactly this many tokens, unless max_tokens comes first.
	HeaderOutputTokens = "X-Sim-Output-Tokens"
)

// requestFaults is the fault injection decided for one request.
type requestFaults struct {
	status     int
	retryAfter time.Duration
	delay      time.Duration
	cutAfter   int // -1: no cut
	refuseFor  time.Duration
}

// requestFaults combines the server's faults (drawing Probability) with the
// request's fault headers.
func (s *Server) requestFaults(r *http.Request) (requestFaults, error) {
	f := *s.faults.Load()
	out := requestFaults{cutAfter: -1, retryAfter: f.RetryAfter, delay: f.Delay}
	if f.Status != 0 {
		p := f.Probability
		if p == 0 {
			p = 1
		}
		if s.chance(p) {
			out.status = f.Status
		}
	}
	if f.CutAfterChunks > 0 {
		out.cutAfter = f.CutAfterChunks
	}
	h := r.Header
	if v := h.Get(HeaderFaultStatus); v != "" {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 400 || n > 599 {
			return out, fmt.Errorf("invalid %s header %q: must be an HTTP error status (400-599)", HeaderFaultStatus, v)
		}
		out.status = n
	}
	if v := h.Get(HeaderFaultRetryAfter); v != "" {
		d, err := parseDurationOr(v, time.Second)
		if err != nil {
			return out, fmt.Errorf("invalid %s header: %w", HeaderFaultRetryAfter, err)
		}
		out.retryAfter = d
	}
	if v := h.Get(HeaderFaultDelay); v != "" {
		d, err := parseDurationOr(v, time.Millisecond)
		if err != nil {
			return out, fmt.Errorf("invalid %s header: %w", HeaderFaultDelay, err)
		}
		out.delay = d
	}
	if v := h.Get(HeaderFaultCutAfter); v != "" {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 0 {
			return out, fmt.Errorf("invalid %s header %q: must be a non-negative integer", HeaderFaultCutAfter, v)
		}
		out.cutAfter = n
	}
	if v := h.Get(HeaderFaultRefuseFor); v != "" {
		d, err := time.ParseDuration(strings.TrimSpace(v))
		if err != nil || d <= 0 {
			return out, fmt.Errorf("invalid %s header %q: must be a positive Go duration", HeaderFaultRefuseFor, v)
		}
		out.refuseFor = d
	}
	return out, nil
}

// parseDurationOr parses a Go duration, or a bare non-negative integer in
// unit.
func parseDurationOr(v string, unit time.Duration) (time.Duration, error) {
	v = strings.TrimSpace(v)
	if n, err := strconv.ParseInt(v, 10, 64); err == nil {
		if n < 0 {
			return 0, fmt.Errorf("%q is negative", v)
		}
		return time.Duration(n) * unit, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("%q is neither an integer nor a duration: %w", v, err)
	}
	if d < 0 {
		return 0, fmt.Errorf("%q is negative", v)
	}
	return d, nil
}

// faultType is the error type vLLM would use for status.
func faultType(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "BadRequestError"
	case http.StatusNotFound:
		return "NotFoundError"
	case http.StatusInternalServerError:
		return "InternalServerError"
	}
	return http.StatusText(status)
}

// faultMessage is the message of an injected fault; 503 uses vLLM's
// overload message so clients cannot tell it from a real one.
func faultMessage(status int) string {
	switch status {
	case http.StatusServiceUnavailable:
		return "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
	case http.StatusTooManyRequests:
		return "Too many requests (injected by vllm-sim)."
	case http.StatusInternalServerError:
		return "Internal server error (injected by vllm-sim)."
	}
	return fmt.Sprintf("%s (injected by vllm-sim).", http.StatusText(status))
}

type cutAfterKey struct{}

func withCutAfter(ctx context.Context, n int) context.Context {
	return context.WithValue(ctx, cutAfterKey{}, n)
}

// cutAfterFrom returns the request's stream-cut fault, if any.
func cutAfterFrom(ctx context.Context) (int, bool) {
	n, ok := ctx.Value(cutAfterKey{}).(int)
	return n, ok
}
