package openai

// Derived is what the reader of another wire format (Anthropic Messages,
// OpenAI Responses) read from a body for the pipeline: the same facts
// ParseRequest reads from a Chat Completions body.
type Derived struct {
	// Stream is the body's "stream".
	Stream bool
	// MaxTokens is the output cap (0: unset) and MaxTokensParam the
	// parameter naming it.
	MaxTokens      int64
	MaxTokensParam string
	// Tools, JSONMode and Images are the capabilities the request needs.
	Tools, JSONMode, Images bool
	// PromptEstimate estimates the prompt tokens.
	PromptEstimate int64
}

// ParseWith validates body as ParseRequest does (one JSON object, no
// member twice, a non-empty UTF-8 "model") and lets derive read the rest
// of it through value (the raw value of a top-level member, nil if
// absent). The body is forwarded with only "model" rewritten: other wire
// formats carry their usage in their own events (no stream_options), so
// IncludeUsage is true (nothing is stripped) and OutputChoices is 1.
func ParseWith(body []byte, derive func(value func(name string) []byte) (Derived, *Error)) (*Request, *Error) {
	r, e := parseObject(body)
	if e != nil {
		return nil, e
	}
	if e := r.interpretModel(); e != nil {
		return nil, e
	}
	d, e := derive(r.value)
	if e != nil {
		return nil, e
	}
	r.foreign = true
	r.stream, r.includeUsage = d.Stream, true
	r.maxTokens, r.maxTokensParam = d.MaxTokens, d.MaxTokensParam
	r.tools, r.jsonMode, r.images = d.Tools, d.JSONMode, d.Images
	r.promptEstimate = d.PromptEstimate
	r.n, r.prompts = 1, 1
	return r, nil
}

// StreamBool reads a "stream"-like boolean member (nil or null: false).
func StreamBool(v []byte, param string) (bool, *Error) {
	switch {
	case isNull(v):
		return false, nil
	case string(v) == "true":
		return true, nil
	case string(v) == "false":
		return false, nil
	}
	return false, parseError(CodeInvalidParameter, param, "%s must be a boolean", param)
}

// NonNegativeInt reads an integer member (nil or null: 0, false).
func NonNegativeInt(v []byte, param string) (n int64, set bool, e *Error) {
	if isNull(v) {
		return 0, false, nil
	}
	n, ok := plainInt(v)
	if !ok || n < 0 {
		return 0, false, parseError(CodeInvalidParameter, param, "%s must be a non-negative integer", param)
	}
	return n, true, nil
}

// SkipWS returns the index of the first non-space byte of b at or after i.
func SkipWS(b []byte, i int) int { return skipWS(b, i) }

// SkipValue returns the offset after the JSON value starting at b[i], b
// valid JSON (a member value of a body ParseWith accepted).
func SkipValue(b []byte, i int) int { return skipValue(b, i) }

// MemberValue returns the raw value of a top-level member of a valid JSON
// object b, nil if absent (the other wire formats read answers with it).
func MemberValue(b []byte, name string) []byte { return memberValue(b, name) }

// IsNull reports whether a raw value is absent or null.
func IsNull(v []byte) bool { return isNull(v) }
