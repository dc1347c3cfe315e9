package anthropic

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

// Error types of Anthropic's error shape.
const (
	TypeInvalidRequest  = "invalid_request_error"
	TypeAuthentication  = "authentication_error"
	TypePermission      = "permission_error"
	TypeNotFound        = "not_found_error"
	TypeRequestTooLarge = "request_too_large"
	TypeRateLimit       = "rate_limit_error"
	TypeAPI             = "api_error"
	TypeOverloaded      = "overloaded_error"
	TypeTimeout         = "timeout_error"
)

// ErrorType maps one of Sluice's errors (the openai table: its status
// and code) to the Anthropic error type a client of this protocol expects.
// The status is kept: Anthropic's SDKs pick their exception by status,
// and Sluice's statuses are the ones Anthropic uses for the same failure
// (401, 403, 404, 413, 429, 500, 503, 504), except that budgets, which
// Sluice answers 429 budget_exceeded, are rate_limit_error here too.
func ErrorType(e *openai.Error) string {
	switch e.Code {
	case openai.CodeOverloaded, openai.CodeNoHealthyDeployment, openai.CodeUpstreamOverloaded,
		openai.CodeBodyReadsSaturated, openai.CodeLimitsUnavailable, openai.CodeLimitsRecovering,
		openai.CodeConfigNotLoaded, openai.CodeStaleConfig:
		return TypeOverloaded
	case openai.CodeUpstreamTimeout, openai.CodeBodyTimeout:
		return TypeTimeout
	case openai.CodeRequestTooLarge:
		return TypeRequestTooLarge
	}
	switch s := e.Status; {
	case s == http.StatusUnauthorized:
		return TypeAuthentication
	case s == http.StatusForbidden:
		return TypePermission
	case s == http.StatusNotFound:
		return TypeNotFound
	case s == http.StatusRequestEntityTooLarge:
		return TypeRequestTooLarge
	case s == http.StatusTooManyRequests:
		return TypeRateLimit
	case s == http.StatusServiceUnavailable || s == 529:
		return TypeOverloaded
	case s == http.StatusGatewayTimeout || s == http.StatusRequestTimeout:
		return TypeTimeout
	case s >= 400 && s < 500:
		return TypeInvalidRequest
	}
	return TypeAPI
}

type errorBody struct {
	Type  string      `json:"type"`
	Error errorFields `json:"error"`
}

// errorFields is Anthropic's error object; code (Sluice's stable code,
// docs/errors.md) is an addition clients that do not know it ignore.
type errorFields struct {
	Type    string `json:"type"`
	Message string `json:"message"`
	Code    string `json:"code,omitempty"`
}

// Body returns e in Anthropic's error shape
// ({"type":"error","error":{"type":…,"message":…,"code":…}}), also the
// data of an SSE error event.
func Body(e *openai.Error) []byte {
	msg := e.Message
	if e.Param != "" && e.Status == http.StatusBadRequest {
		msg = e.Param + ": " + msg
	}
	b, _ := json.Marshal(errorBody{Type: "error", Error: errorFields{Type: ErrorType(e), Message: msg, Code: e.Code}})
	return b
}

// WriteError answers e in Anthropic's error shape, with retry-after (and
// retry-after-ms) when it is retryable after a delay and x-should-retry:
// false when retrying cannot help, as openai.WriteError does.
func WriteError(w http.ResponseWriter, e *openai.Error) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	if e.RetryAfter > 0 {
		secs := int64((e.RetryAfter + time.Second - 1) / time.Second)
		h.Set("Retry-After", strconv.FormatInt(secs, 10))
		h.Set("Retry-After-Ms", strconv.FormatInt(e.RetryAfter.Milliseconds(), 10))
	}
	if e.NoRetry {
		h.Set("X-Should-Retry", "false")
	}
	b := append(Body(e), '\n')
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(e.Status)
	_, _ = w.Write(b)
}

// ErrorEvent is e as an SSE error event (sent once the headers are out),
// as Anthropic's API sends one mid-stream.
func ErrorEvent(e *openai.Error) []byte {
	out := append([]byte("event: error\ndata: "), Body(e)...)
	return append(out, '\n', '\n')
}
