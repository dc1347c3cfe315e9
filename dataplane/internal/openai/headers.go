package openai

// RequestIDHeader carries the request id on every answer; the data
// plane's middleware sets it, the gateway sets one when it is missing.
const RequestIDHeader = "X-Sluice-Request-Id"

// Attribution headers (SPEC §9.2). They are for attribution only and never
// grant anything. The body's "user" field is never used for attribution:
// keys carry no setting that would allow it, and a client-chosen body
// field must not be able to move spend between customers.
const (
	HeaderEndUser = "X-Sluice-End-User"
	// HeaderAttempts is on every answer that reached the forward stage:
	// the upstream attempts made (retries included).
	HeaderAttempts = "X-Sluice-Attempts"
	// HeaderModelGroup is the model group whose deployment the last
	// attempt went to: the requested one, or a fallback group.
	HeaderModelGroup = "X-Sluice-Model-Group"
	HeaderAgentID    = "X-Sluice-Agent-Id"
	HeaderSession    = "X-Session-Id"
)

// Headers naming the scope and limit of a rejection.
const (
	HeaderLimitScope = "X-Sluice-Limit-Scope"
	HeaderLimitType  = "X-Sluice-Limit-Type"
)
