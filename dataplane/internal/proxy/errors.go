package proxy

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"
)

// Error types of the OpenAI error shape (SPEC §9.1). The table of every
// type and code with its status is docs/errors.md.
const (
	TypeInvalidRequest     = "invalid_request_error"
	TypePermission         = "permission_error"
	TypeNotFound           = "not_found_error"
	TypeServiceUnavailable = "service_unavailable"
	TypeUpstream           = "upstream_error"
	TypeTimeout            = "timeout_error"
)

// Error codes.
const (
	CodeRequestTooLarge      = "request_too_large"
	CodeInvalidJSON          = "invalid_json"
	CodeInvalidParameter     = "invalid_parameter"
	CodeMissingRequiredParam = "missing_required_param"
	CodeInvalidHeader        = "invalid_header"
	CodeMissingAPIKey        = "missing_api_key"
	CodeInvalidAPIKey        = "invalid_api_key"
	CodeKeyExpired           = "key_expired"
	CodeRouteNotAllowed      = "route_not_allowed"
	CodeModelNotFound        = "model_not_found"
	CodeModelNotAllowed      = "model_not_allowed"
	CodeUnsupportedParameter = "unsupported_parameter"
	CodeNoHealthyDeployment  = "no_healthy_deployment"
	CodeOverloaded           = "overloaded"
	CodeUpstreamError        = "upstream_error"
	CodeUpstreamUnavailable  = "upstream_unavailable"
	CodeUpstreamTimeout      = "upstream_timeout"
	CodeUpstreamStreamError  = "upstream_stream_error"
	CodeUnknownRoute         = "unknown_route"
	CodeMethodNotAllowed     = "method_not_allowed"
	// CodeCustomerBlocked refuses a request made on behalf of a blocked end
	// customer (x-sluice-end-user, looked up in the key's org).
	CodeCustomerBlocked = "customer_blocked"
	// CodeClientClosed is recorded (never sent) when the client went away.
	CodeClientClosed = "client_closed_request"
	// CodeUpstreamClientError is recorded when an upstream 4xx answer was
	// passed through to the client.
	CodeUpstreamClientError = "upstream_client_error"
	// blocked codes are <scope>_blocked: key_blocked, user_blocked,
	// team_blocked, org_blocked (see blockedError).
)

// StatusClientClosed is the status recorded for a request whose client
// disconnected before the answer was complete (nginx's 499).
const StatusClientClosed = 499

// Error is one answer in the OpenAI error shape with its HTTP status and
// client hints. It is the only way the proxy reports a failure.
type Error struct {
	// Status is the HTTP status.
	Status int
	// Type and Code are stable identifiers (docs/errors.md).
	Type, Code string
	// Param names the offending request parameter or header, if any.
	Param string
	// Message is for humans; it never contains internal addresses,
	// credentials or prompt text.
	Message string
	// RetryAfter, when positive, is sent as Retry-After (seconds, rounded
	// up) and Retry-After-Ms.
	RetryAfter time.Duration
	// NoRetry sends x-should-retry: false (retrying cannot help).
	NoRetry bool
}

func (e *Error) Error() string { return e.Code + ": " + e.Message }

type errorBody struct {
	Error errorFields `json:"error"`
}

type errorFields struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    string  `json:"code"`
}

func (e *Error) body() []byte {
	f := errorFields{Message: e.Message, Type: e.Type, Code: e.Code}
	if e.Param != "" {
		f.Param = &e.Param
	}
	b, _ := json.Marshal(errorBody{Error: f}) // cannot fail: strings only
	return b
}

// WriteError answers e in the OpenAI error shape.
func WriteError(w http.ResponseWriter, e *Error) {
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
	b := append(e.body(), '\n')
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(e.Status)
	_, _ = w.Write(b)
}

func invalidRequest(code, param, msg string) *Error {
	return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Code: code, Param: param, Message: msg, NoRetry: true}
}

func unauthorized(code, msg string) *Error {
	return &Error{Status: http.StatusUnauthorized, Type: TypeInvalidRequest, Code: code, Message: msg, NoRetry: true}
}

func forbidden(code, param, msg string) *Error {
	return &Error{Status: http.StatusForbidden, Type: TypePermission, Code: code, Param: param, Message: msg, NoRetry: true}
}

func unavailable(code, msg string, retryAfter time.Duration) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: TypeServiceUnavailable, Code: code, Message: msg, RetryAfter: retryAfter}
}
