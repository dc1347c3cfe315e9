// Package openai is the OpenAI wire format of the data plane and nothing
// else: the request body scanner (ParseRequest), the error table and the
// OpenAI error shape (errors.go), the SSE event reader (sse.go), the usage
// object (usage.go) and the shapes of engines' error answers
// (engineerr.go). It is pure: no I/O beyond the ResponseWriter it is handed,
// no clock, no catalog, no metrics, so the gateway, routing, forwarding and
// a control-plane "explain" can share it.
package openai

// ParseRequest validates body as one JSON object and reads the fields the
// proxy needs (see parseRequest).
func ParseRequest(body []byte) (*Request, *Error) { return parseRequest(body) }

// Model is the body's "model".
func (r *Request) Model() string { return r.model }

// Stream is the body's "stream".
func (r *Request) Stream() bool { return r.stream }

// IncludeUsage is stream_options.include_usage: whether the client asked
// for the usage chunk.
func (r *Request) IncludeUsage() bool { return r.includeUsage }

// MaxTokens is max_completion_tokens, else max_tokens (0: unset), and
// MaxTokensParam the parameter it came from.
func (r *Request) MaxTokens() int64       { return r.maxTokens }
func (r *Request) MaxTokensParam() string { return r.maxTokensParam }

// Tools, JSONMode and Images say whether the request needs tool calling,
// JSON mode (a response_format other than text) or image input.
func (r *Request) Tools() bool    { return r.tools }
func (r *Request) JSONMode() bool { return r.jsonMode }
func (r *Request) Images() bool   { return r.images }

// PromptEstimate estimates the prompt tokens (about 4 bytes of text per
// token; token-ID prompts count one per ID).
func (r *Request) PromptEstimate() int64 { return r.promptEstimate }

// OutputChoices is prompts × max(n, best_of), at least 1: the sequences
// the engine may generate. ChoicesParam names the parameter that makes it
// larger than 1 ("" when it is 1).
func (r *Request) OutputChoices() int64 { return r.outputChoices() }
func (r *Request) ChoicesParam() string { return r.choicesParam }

// Has reports whether the body sets the dotted parameter path to a
// non-null value.
func (r *Request) Has(path string) bool { return r.has(path) }

// Value returns the raw value of a top-level member, nil if absent.
func (r *Request) Value(name string) []byte { return r.value(name) }

// Rewrite returns the body to forward to a deployment serving
// upstreamModel (see rewrite).
func (r *Request) Rewrite(upstreamModel string) []byte { return r.rewrite(upstreamModel, nil) }

// RewriteWithPriority is Rewrite with the engine priority the proxy chose
// as the body's "priority" (nil: none sent). The client's own priority is
// removed either way.
func (r *Request) RewriteWithPriority(upstreamModel string, priority *int32) []byte {
	return r.rewrite(upstreamModel, priority)
}

// MulBounded returns a × b for non-negative a and b, and whether it is at
// most limit.
func MulBounded(a, b, limit int64) (int64, bool) { return mulBounded(a, b, limit) }

// PromptParam names the parameter carrying the prompt of a route.
func PromptParam(route string) string {
	switch route {
	case RouteChat:
		return "messages"
	case RouteEmbeddings:
		return "input"
	}
	return "prompt"
}

// Routes.
const (
	RouteChat        = "/v1/chat/completions"
	RouteCompletions = "/v1/completions"
	RouteEmbeddings  = "/v1/embeddings"
	RouteModels      = "/v1/models"
)
