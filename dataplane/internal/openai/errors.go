package openai

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"
)

// The error table of the data plane: every type and code the proxy answers
// (or records in the usage ledger) is declared here, once. docs/errors.md
// lists them with their statuses; the constructors at the end of this file
// are the only places statuses and types are paired.

// Error types of the OpenAI error shape (SPEC §9.1).
const (
	TypeInvalidRequest     = "invalid_request_error"
	TypePermission         = "permission_error"
	TypeNotFound           = "not_found_error"
	TypeServiceUnavailable = "service_unavailable"
	TypeUpstream           = "upstream_error"
	TypeTimeout            = "timeout_error"
	TypeRateLimit          = "rate_limit_error"
	// TypeBudgetExceeded is the type of a budget rejection (SPEC §8.3).
	TypeBudgetExceeded = "budget_exceeded"
)

// Error codes: the request and its body.
const (
	CodeRequestTooLarge      = "request_too_large"
	CodeInvalidJSON          = "invalid_json"
	CodeInvalidParameter     = "invalid_parameter"
	CodeMissingRequiredParam = "missing_required_param"
	CodeInvalidHeader        = "invalid_header"
	CodeUnsupportedParameter = "unsupported_parameter"
	CodeUnknownRoute         = "unknown_route"
	CodeMethodNotAllowed     = "method_not_allowed"
	// CodeEstimateTooLarge refuses a request whose output cap, token
	// estimate or maximum cost exceeds what Sluice accounts for one request
	// (MaxEstimateTokens, MaxReservationMicros); param names the parameter
	// that multiplies it.
	CodeEstimateTooLarge = "estimate_too_large"
	// CodeBodyTimeout: the body did not arrive within the body read
	// timeout.
	CodeBodyTimeout = "request_body_timeout"
	// CodeIncompleteBody: the body ended before its declared length (a
	// half-closed HTTP/1.1 connection, an HTTP/2 stream ended early) or its
	// chunked framing is broken.
	CodeIncompleteBody = "incomplete_body"
	// CodeBodyReadsSaturated: this instance is reading as many bodies as it
	// allows at once.
	CodeBodyReadsSaturated = "body_reads_saturated"
	// CodeTooManyConcurrentBodies: one connection is sending more bodies
	// at once than allowed (HTTP/2).
	CodeTooManyConcurrentBodies = "too_many_concurrent_bodies"
	// CodeClientClosed is recorded (never sent) when the client went away.
	CodeClientClosed = "client_closed_request"
)

// Error codes: readiness and authentication.
const (
	// CodeConfigNotLoaded: no configuration snapshot loaded yet.
	CodeConfigNotLoaded = "config_not_loaded"
	// CodeStaleConfig: no contact with the control plane for longer than
	// the maximum staleness, under the reject policy.
	CodeStaleConfig   = "stale_config"
	CodeMissingAPIKey = "missing_api_key"
	CodeInvalidAPIKey = "invalid_api_key"
	CodeKeyExpired    = "key_expired"
	// JWT credentials (authn.JWT, docs/jwt.md): a token that is no JWS or
	// fails verification (signature, an algorithm other than its key's,
	// alg "none", HMAC, no exp); past exp or before nbf; an "iss" no org
	// trusts, or trusted for other audiences; a "kid" the issuer's JWKS
	// does not hold (after a bounded refresh); the issuer's keys
	// unreachable for longer than the stale bound; a team or user claim
	// naming nobody of the org under the refuse policy.
	CodeInvalidToken           = "invalid_token"
	CodeTokenExpired           = "token_expired"
	CodeUntrustedIssuer        = "untrusted_issuer"
	CodeInvalidAudience        = "invalid_audience"
	CodeUnknownSigningKey      = "unknown_signing_key"
	CodeSigningKeysUnavailable = "signing_keys_unavailable"
	CodeUnknownIdentity        = "unknown_identity"
	// Blocked codes are <scope>_blocked: key_blocked, user_blocked,
	// team_blocked, org_blocked (BlockedCode).
	CodeRouteNotAllowed = "route_not_allowed"
	CodeModelNotFound   = "model_not_found"
	CodeModelNotAllowed = "model_not_allowed"
	// CodeCustomerBlocked refuses a request made on behalf of a blocked end
	// customer (x-sluice-end-user, looked up in the key's org).
	CodeCustomerBlocked = "customer_blocked"
)

// Error codes: limits (SPEC §8; docs/limits.md).
const (
	CodeRateLimitExceeded        = "rate_limit_exceeded"
	CodeTokenRateLimitExceeded   = "token_rate_limit_exceeded"
	CodeConcurrencyLimitExceeded = "concurrency_limit_exceeded"
	CodeBudgetExceeded           = "budget_exceeded"
	// CodeLimitsUnavailable: Redis is unreachable or slower than the
	// per-call timeout; limits fail closed.
	CodeLimitsUnavailable = "limits_unavailable"
	// CodeLimitsRecovering: Redis lost its state moments ago; concurrency
	// limited scopes wait until live requests re-asserted their leases,
	// and budgets whose window Redis does not hold until it is re-seeded
	// from the ledger (limits.Rejection.Unseeded).
	CodeLimitsRecovering = "limits_recovering"
	// CodeProxyLost is the error code of the usage event a sweeper
	// publishes for a request whose proxy died before finishing it: never
	// sent to a client, only recorded in the ledger.
	CodeProxyLost = "proxy_lost"
)

// Error codes: deployments and upstreams. Every upstream failure reaches
// the client as one of the upstream_* codes below (never an engine's own
// body); the constructors Upstream* at the end of this file pair them with
// their statuses, types and retry hints.
const (
	CodeNoHealthyDeployment = "no_healthy_deployment"
	CodeOverloaded          = "overloaded"
	// CodeUpstreamError: the engine failed (500, 501, 502, 404/405 for a
	// misconfigured deployment), could not be reached, or broke the
	// connection.
	CodeUpstreamError = "upstream_error"
	// CodeUpstreamRateLimited: the engine answered 429 (on every
	// deployment tried).
	CodeUpstreamRateLimited = "upstream_rate_limited"
	// CodeUpstreamOverloaded: the engine answered 503 (vLLM's admission
	// valve, "queue full", or another 503) on every deployment tried.
	CodeUpstreamOverloaded = "upstream_overloaded"
	// CodeUpstreamTimeout: the request's total deadline passed, the engine
	// answered 504, or no stream's first token came within the TTFT
	// deadline on any attempt.
	CodeUpstreamTimeout     = "upstream_timeout"
	CodeUpstreamStreamError = "upstream_stream_error"
	// CodeUpstreamBadRequest: the engine refused the request (a 4xx other
	// than 401, 403, 404, 405 and 429); the answer carries the engine's
	// message, sanitised.
	CodeUpstreamBadRequest = "upstream_bad_request"
	// CodeUpstreamAuthFailed: the engine refused the deployment's
	// credential (401/403); the client's own key is fine.
	CodeUpstreamAuthFailed = "upstream_auth_failed"
	// CodeInternal: an unexpected failure (a bug or a panic); the message
	// carries the request id, never the cause.
	CodeInternal = "internal_error"
)

// Error codes: wire protocols other than Chat Completions
// (docs/protocols.md).
const (
	// CodeProtocolNotServed: no deployment of the model group declares
	// the route's protocol (capabilities.protocols).
	CodeProtocolNotServed = "protocol_not_served"
	// CodePreviousResponseNotFound: previous_response_id (or the id of a
	// GET or cancel) names no Response this key created, or one whose
	// record expired.
	CodePreviousResponseNotFound = "previous_response_not_found"
	// CodePreviousResponseUnavailable: the deployment holding the
	// referenced Response is gone, serves another group now, or may not
	// serve this request.
	CodePreviousResponseUnavailable = "previous_response_unavailable"
	// CodeResponseStoreUnavailable: the Responses table in Redis could not
	// be read; a follow-up is refused rather than sent to an engine that
	// does not hold its Response.
	CodeResponseStoreUnavailable = "response_store_unavailable"
	// CodeResponseNotFound: GET or cancel of a Response this key did not
	// create through this gateway (or whose record expired).
	CodeResponseNotFound = "response_not_found"
)

// BlockedCode is the code refusing a key whose scope (key, user, team,
// org) is blocked.
func BlockedCode(scope string) string { return scope + "_blocked" }

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
	// NoRetry sends x-should-retry: false (retrying cannot help); Retry
	// sends x-should-retry: true (a retry, after RetryAfter, can help).
	NoRetry, Retry bool
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

// Body returns e as an OpenAI error object (also the data of an SSE error
// event).
func (e *Error) Body() []byte {
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
	switch {
	case e.NoRetry:
		h.Set("X-Should-Retry", "false")
	case e.Retry:
		h.Set("X-Should-Retry", "true")
	}
	b := append(e.Body(), '\n')
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(e.Status)
	_, _ = w.Write(b)
}

// InvalidRequest is a 400 invalid_request_error (not retryable).
func InvalidRequest(code, param, msg string) *Error {
	return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Code: code, Param: param, Message: msg, NoRetry: true}
}

func invalidRequest(code, param, msg string) *Error { return InvalidRequest(code, param, msg) }

// Unauthorized is a 401 (not retryable).
func Unauthorized(code, msg string) *Error {
	return &Error{Status: http.StatusUnauthorized, Type: TypeInvalidRequest, Code: code, Message: msg, NoRetry: true}
}

// Forbidden is a 403 permission_error (not retryable).
func Forbidden(code, param, msg string) *Error {
	return &Error{Status: http.StatusForbidden, Type: TypePermission, Code: code, Param: param, Message: msg, NoRetry: true}
}

// Unavailable is a 503 service_unavailable, retryable after retryAfter.
func Unavailable(code, msg string, retryAfter time.Duration) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: TypeServiceUnavailable, Code: code, Message: msg, RetryAfter: retryAfter}
}

// ModelNotFound is the 404 of a model name that names no model group the
// caller's org may use: none exists, or it is neither platform-wide nor
// granted to the org (docs/tenancy.md). Both answer alike, so an org
// learns nothing of groups it was not granted.
func ModelNotFound(model string) *Error {
	return &Error{Status: http.StatusNotFound, Type: TypeNotFound, Code: CodeModelNotFound, Param: "model", NoRetry: true,
		Message: "the model " + strconv.Quote(model) + " does not exist or is not granted to this organization"}
}

// Upstream is a 502 upstream_error.
func Upstream(code, msg string) *Error {
	return &Error{Status: http.StatusBadGateway, Type: TypeUpstream, Code: code, Message: msg}
}

// ClientClosed is recorded when the client went away (never sent).
func ClientClosed() *Error {
	return &Error{Status: StatusClientClosed, Type: TypeInvalidRequest, Code: CodeClientClosed, Message: "the client closed the request"}
}

// minUpstreamRetryAfter is the least retry-after of a retryable upstream
// failure.
const minUpstreamRetryAfter = time.Second

// UpstreamFailed is a 502 upstream_error (engine 5xx, unreachable, broken
// connection); a client retry can help.
func UpstreamFailed(msg string) *Error {
	return &Error{Status: http.StatusBadGateway, Type: TypeUpstream, Code: CodeUpstreamError, Message: msg,
		RetryAfter: minUpstreamRetryAfter, Retry: true}
}

// UpstreamRateLimited is the 429 upstream_rate_limited of an engine that
// answered 429 (its Retry-After, at least 1 s).
func UpstreamRateLimited(msg string, retryAfter time.Duration) *Error {
	return &Error{Status: http.StatusTooManyRequests, Type: TypeRateLimit, Code: CodeUpstreamRateLimited, Message: msg,
		RetryAfter: max(retryAfter, minUpstreamRetryAfter), Retry: true}
}

// UpstreamOverloaded is the 503 upstream_overloaded of an engine that
// answered 503 (its Retry-After, at least 1 s).
func UpstreamOverloaded(msg string, retryAfter time.Duration) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: TypeServiceUnavailable, Code: CodeUpstreamOverloaded, Message: msg,
		RetryAfter: max(retryAfter, minUpstreamRetryAfter), Retry: true}
}

// UpstreamTimeout is a 504 upstream_timeout. retryable: the time ran out
// on one attempt (an engine 504, a TTFT deadline), not the request's total
// deadline, so a new request can help.
func UpstreamTimeout(msg string, retryable bool) *Error {
	e := &Error{Status: http.StatusGatewayTimeout, Type: TypeTimeout, Code: CodeUpstreamTimeout, Message: msg}
	if retryable {
		e.RetryAfter, e.Retry = minUpstreamRetryAfter, true
	} else {
		e.NoRetry = true
	}
	return e
}

// UpstreamBadRequest is the engine's refusal of the request (its 4xx
// status, 422 as 400) with its message: retrying cannot help.
func UpstreamBadRequest(status int, param, msg string) *Error {
	if status == http.StatusUnprocessableEntity {
		status = http.StatusBadRequest
	}
	return &Error{Status: status, Type: TypeInvalidRequest, Code: CodeUpstreamBadRequest, Param: param, Message: msg, NoRetry: true}
}
