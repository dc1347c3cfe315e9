package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"
)

// span is a byte range [start, end) of the request body.
type span struct{ start, end int }

// field is one top-level member of the request object.
type field struct {
	name string
	val  span
}

// request is what the proxy reads from a request body: only what it needs
// to authorise, route and account (SPEC §7). Everything else is forwarded
// byte for byte; only the value of "model" and of "stream_options" are
// rewritten (rewrite).
type request struct {
	body   []byte
	fields []field
	// closing is the offset of the object's closing brace.
	closing int

	model string
	// stream is the body's "stream"; includeUsage its
	// stream_options.include_usage: whether the client asked for the usage
	// chunk.
	stream, includeUsage bool
	// maxTokens is max_completion_tokens, else max_tokens (0: unset), and
	// maxTokensParam the parameter it came from.
	maxTokens      int64
	maxTokensParam string
	// tools, jsonMode and images say whether the request needs those
	// capabilities (tools or functions; a response_format other than
	// text; image parts in messages).
	tools, jsonMode, images bool
	// promptEstimate estimates the prompt tokens: about 4 bytes of text
	// per token (token-ID prompts count one per ID). It is used to keep
	// long prompts away from deployments with a smaller max_input_tokens
	// and as the prompt size of a request that ends before the upstream
	// reported usage.
	promptEstimate int64
}

// parseError is a body that cannot be used.
func parseError(code, param, format string, args ...any) *Error {
	return invalidRequest(code, param, fmt.Sprintf(format, args...))
}

// parseRequest validates body as one JSON object and reads the fields the
// proxy needs. Member names are compared after decoding their escapes, and
// a member given twice is refused, so that the proxy and the upstream can
// never read different values from one body.
func parseRequest(body []byte) (*request, *Error) {
	if !json.Valid(body) {
		return nil, parseError(CodeInvalidJSON, "", "the request body is not valid JSON")
	}
	i := skipWS(body, 0)
	if body[i] != '{' {
		return nil, parseError(CodeInvalidJSON, "", "the request body must be a JSON object")
	}
	r := &request{body: body}
	i = skipWS(body, i+1)
	for body[i] != '}' {
		ks := i
		i = skipString(body, i)
		name, err := decodeKey(body[ks:i])
		if err != nil {
			return nil, parseError(CodeInvalidJSON, "", "the request body has an unreadable member name")
		}
		i = skipWS(body, i)
		i = skipWS(body, i+1) // ':'
		vs := i
		i = skipValue(body, i)
		for _, f := range r.fields {
			if f.name == name {
				return nil, parseError(CodeInvalidJSON, name, "the request body has the member %q twice", name)
			}
		}
		r.fields = append(r.fields, field{name: name, val: span{vs, i}})
		i = skipWS(body, i)
		if body[i] == ',' {
			i = skipWS(body, i+1)
		}
	}
	r.closing = i
	if e := r.interpret(); e != nil {
		return nil, e
	}
	return r, nil
}

// value returns the raw value of a top-level member, nil if absent.
func (r *request) value(name string) []byte {
	for _, f := range r.fields {
		if f.name == name {
			return r.body[f.val.start:f.val.end]
		}
	}
	return nil
}

func (r *request) span(name string) (span, bool) {
	for _, f := range r.fields {
		if f.name == name {
			return f.val, true
		}
	}
	return span{}, false
}

func isNull(v []byte) bool { return v == nil || string(v) == "null" }

func (r *request) interpret() *Error {
	mv := r.value("model")
	if isNull(mv) {
		return parseError(CodeMissingRequiredParam, "model", "you must provide a model parameter")
	}
	if s, ok := plainString(mv); ok {
		r.model = s
	} else if err := json.Unmarshal(mv, &r.model); err != nil {
		return parseError(CodeInvalidParameter, "model", "model must be a non-empty string")
	}
	if r.model == "" {
		return parseError(CodeInvalidParameter, "model", "model must be a non-empty string")
	}
	if !utf8.ValidString(r.model) || strings.ContainsRune(r.model, 0) {
		// It is recorded in the usage ledger, which takes UTF-8 text only.
		return parseError(CodeInvalidParameter, "model", "model must be UTF-8 text without NUL characters")
	}
	if v := r.value("stream"); !isNull(v) {
		switch string(v) {
		case "true":
			r.stream = true
		case "false":
		default:
			return parseError(CodeInvalidParameter, "stream", "stream must be a boolean")
		}
	}
	if v := r.value("stream_options"); !isNull(v) {
		var so struct {
			IncludeUsage *bool `json:"include_usage"`
		}
		if v[0] != '{' || json.Unmarshal(v, &so) != nil {
			return parseError(CodeInvalidParameter, "stream_options", "stream_options must be an object with a boolean include_usage")
		}
		r.includeUsage = so.IncludeUsage != nil && *so.IncludeUsage
	}
	for _, p := range []string{"max_tokens", "max_completion_tokens"} {
		v := r.value(p)
		if isNull(v) {
			continue
		}
		n, ok := plainInt(v)
		if !ok {
			if err := json.Unmarshal(v, &n); err != nil {
				n = -1
			}
		}
		if n < 0 {
			return parseError(CodeInvalidParameter, p, "%s must be a non-negative integer", p)
		}
		r.maxTokens, r.maxTokensParam = n, p // max_completion_tokens wins, as in OpenAI's API
	}
	for _, p := range []string{"tools", "functions"} {
		v := r.value(p)
		if isNull(v) {
			continue
		}
		if v[0] != '[' {
			return parseError(CodeInvalidParameter, p, "%s must be an array", p)
		}
		if v[skipWS(v, 1)] != ']' {
			r.tools = true
		}
		r.promptEstimate += int64(len(v)) / 4
	}
	if v := r.value("response_format"); !isNull(v) {
		var rf struct {
			Type string `json:"type"`
		}
		if v[0] != '{' || json.Unmarshal(v, &rf) != nil {
			return parseError(CodeInvalidParameter, "response_format", "response_format must be an object with a type")
		}
		r.jsonMode = rf.Type != "" && rf.Type != "text"
	}
	if v := r.value("messages"); !isNull(v) {
		n, images, ok := estimateMessages(v)
		if !ok {
			return parseError(CodeInvalidParameter, "messages", "messages must be an array of message objects")
		}
		r.promptEstimate += n
		r.images = images
	}
	for _, p := range []string{"prompt", "input"} {
		if v := r.value(p); !isNull(v) {
			r.promptEstimate += estimatePrompt(v)
		}
	}
	return nil
}

// estimateMessages estimates the prompt tokens of a chat request and says
// whether it carries image parts. Only when the raw text mentions an image
// part type are the messages decoded (images would otherwise dominate a
// size-based estimate).
func estimateMessages(v []byte) (tokens int64, images, ok bool) {
	if v[0] != '[' {
		return 0, false, false
	}
	if !bytes.Contains(v, []byte("image")) {
		return int64(len(v)) / 4, false, true
	}
	var msgs []struct {
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(v, &msgs) != nil {
		return 0, false, false
	}
	var text int64
	for _, m := range msgs {
		switch {
		case len(m.Content) == 0 || m.Content[0] != '[':
			text += int64(len(m.Content))
		default:
			var parts []struct {
				Type string `json:"type"`
				Text string `json:"text"`
			}
			if json.Unmarshal(m.Content, &parts) != nil {
				return 0, false, false
			}
			for _, p := range parts {
				if p.Type == "image_url" || p.Type == "input_image" || p.Type == "image" {
					images = true
				}
				text += int64(len(p.Text))
			}
		}
	}
	return text / 4, images, true
}

// estimatePrompt estimates the tokens of a completions prompt or an
// embeddings input: a string or strings (4 bytes per token), or token IDs
// (one per ID).
func estimatePrompt(v []byte) int64 {
	if v[0] == '[' {
		if j := skipWS(v, 1); j < len(v) && (v[j] >= '0' && v[j] <= '9' || v[j] == '[') && !bytes.Contains(v, []byte{'"'}) {
			return int64(bytes.Count(v, []byte{','})) + 1
		}
	}
	return int64(len(v)) / 4
}

// has reports whether the body sets the dotted parameter path (e.g. "user"
// or "metadata.generation_name") to a non-null value.
func (r *request) has(path string) bool {
	first, rest, nested := strings.Cut(path, ".")
	v := r.value(first)
	for nested && !isNull(v) {
		var obj map[string]json.RawMessage
		if v[0] != '{' || json.Unmarshal(v, &obj) != nil {
			return false
		}
		first, rest, nested = strings.Cut(rest, ".")
		v = obj[first]
	}
	return !isNull(v)
}

// rewrite returns the body to send upstream: "model" set to upstreamModel
// and, for a stream, stream_options.include_usage set to true (the proxy
// always needs the usage; it strips the usage chunk for clients that did
// not ask for it). Every other byte is the client's.
func (r *request) rewrite(upstreamModel string) []byte {
	type splice struct {
		at   span
		with []byte
	}
	var ss []splice
	if upstreamModel != r.model {
		q := quote(upstreamModel)
		ms, _ := r.span("model")
		ss = append(ss, splice{ms, q})
	}
	if r.stream && !r.includeUsage {
		so, ok := r.span("stream_options")
		switch v := r.body[so.start:so.end]; {
		case !ok:
			ss = append(ss, splice{span{r.closing, r.closing}, []byte(`,"stream_options":{"include_usage":true}`)})
		case isNull(v):
			ss = append(ss, splice{so, []byte(`{"include_usage":true}`)})
		default:
			var obj map[string]json.RawMessage
			_ = json.Unmarshal(v, &obj) // checked by interpret
			obj["include_usage"] = json.RawMessage("true")
			b, _ := json.Marshal(obj)
			ss = append(ss, splice{so, b})
		}
	}
	if len(ss) == 0 {
		return r.body
	}
	if len(ss) == 2 && ss[1].at.start < ss[0].at.start {
		ss[0], ss[1] = ss[1], ss[0]
	}
	out := make([]byte, 0, len(r.body)+64)
	prev := 0
	for _, s := range ss {
		out = append(out, r.body[prev:s.at.start]...)
		out = append(out, s.with...)
		prev = s.at.end
	}
	return append(out, r.body[prev:]...)
}

// memberValue returns the raw value of the top-level member name of b, a
// JSON object that json.Valid accepted; nil when b is not an object or has
// no such member. Names match as encoding/json matches a struct field
// (case-insensitively; the last of several wins).
func memberValue(b []byte, name string) []byte {
	i := skipWS(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil
	}
	var found []byte
	i = skipWS(b, i+1)
	for b[i] != '}' {
		ks := i
		i = skipString(b, i)
		var match bool
		if k := b[ks+1 : i-1]; bytes.IndexByte(k, '\\') < 0 {
			match = bytes.EqualFold(k, []byte(name))
		} else if key, err := decodeKey(b[ks:i]); err == nil {
			match = strings.EqualFold(key, name)
		}
		i = skipWS(b, i)
		i = skipWS(b, i+1) // ':'
		vs := i
		i = skipValue(b, i)
		if match {
			found = b[vs:i]
		}
		i = skipWS(b, i)
		if b[i] == ',' {
			i = skipWS(b, i+1)
		}
	}
	return found
}

// plainString returns the value of a JSON string literal that needs no
// decoding (printable ASCII without escapes), as encoding/json would.
func plainString(v []byte) (string, bool) {
	if len(v) < 2 || v[0] != '"' || v[len(v)-1] != '"' {
		return "", false
	}
	for _, c := range v[1 : len(v)-1] {
		if c < 0x20 || c >= 0x7f || c == '\\' || c == '"' {
			return "", false
		}
	}
	return string(v[1 : len(v)-1]), true
}

// plainInt returns the value of a JSON number made of at most 18 digits
// (no sign, fraction or exponent), as encoding/json would into an int64.
func plainInt(v []byte) (int64, bool) {
	if len(v) == 0 || len(v) > 18 || (v[0] == '0' && len(v) > 1) {
		return 0, false
	}
	var n int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

// quote encodes s as a JSON string, byte for byte as json.Marshal does.
func quote(s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '\\' || c == '"' || c == '<' || c == '>' || c == '&' {
			q, _ := json.Marshal(s) // a string cannot fail
			return q
		}
	}
	q := make([]byte, 0, len(s)+2)
	return append(append(append(q, '"'), s...), '"')
}

// The scanners below run on input json.Valid accepted, so they only find
// boundaries and never check syntax.

func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipString returns the offset after the string starting at b[i] == '"'.
func skipString(b []byte, i int) int {
	for i++; ; i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
}

// skipValue returns the offset after the value starting at b[i].
func skipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for {
			switch b[i] {
			case '"':
				i = skipString(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
	default:
		for ; i < len(b); i++ {
			switch b[i] {
			case ',', '}', ']', ' ', '\t', '\r', '\n':
				return i
			}
		}
		return i
	}
}

// decodeKey decodes a member name, escapes included ("mod\u0065l" is
// "model" to the upstream's JSON parser too).
func decodeKey(q []byte) (string, error) {
	if !bytes.ContainsRune(q, '\\') {
		return string(q[1 : len(q)-1]), nil
	}
	var s string
	err := json.Unmarshal(q, &s)
	return s, err
}
