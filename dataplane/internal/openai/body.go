package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/maphash"
	"math/bits"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// span is a byte range [start, end) of the request body.
type span struct{ start, end int }

// field is one top-level member of the request object: its name between
// the quotes (no string is made of it unless it holds escapes: see
// request.names) and its value.
type field struct{ key, val span }

// Request is what the proxy reads from a request body: only what it needs
// to authorise, route and account (SPEC §7). Everything else is forwarded
// byte for byte; only the value of "model" and of "stream_options" are
// rewritten and "priority" is removed or set (rewrite).
type Request struct {
	body   []byte
	fields []field
	// names holds the decoded names of the members whose names have
	// escapes, by position in fields.
	names map[int]string
	// index, once there are more than indexAfter members (nil below: a
	// scan is faster), holds one entry per member, sorted: the hash of its
	// name (nameSeed) above indexBits, its position in fields below. The
	// duplicate check and the lookups use it, so that they stay linear (one
	// sort) in the body size whatever the number of members.
	index     []uint64
	indexBits uint
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
	// sampling: n, best_of and the prompts of a batch (sampling.go).
	sampling
	// foreign marks a body of another wire format (ParseWith): forwarded
	// with only "model" rewritten.
	foreign bool
}

// parseError is a body that cannot be used.
func parseError(code, param, format string, args ...any) *Error {
	return invalidRequest(code, param, fmt.Sprintf(format, args...))
}

// indexAfter is the member count above which members are found through
// request.index rather than by a scan of the fields (a scan of a few short
// names beats hashing them).
const indexAfter = 16

// nameSeed seeds the hashes of member names; random per process, so that
// no client can choose names that collide.
var nameSeed = maphash.MakeSeed()

// parseRequest validates body as one JSON object and reads the fields the
// proxy needs. Member names are compared after decoding their escapes, and
// a member given twice is refused, so that the proxy and the upstream can
// never read different values from one body. It runs in time linear in the
// body's size whatever its number of members (json.Valid, one pass over
// the top level, past indexAfter members one sort of their name hashes)
// and makes no string of a name without escapes.
func parseRequest(body []byte) (*Request, *Error) {
	r, e := parseObject(body)
	if e != nil {
		return nil, e
	}
	if e := r.interpret(); e != nil {
		return nil, e
	}
	return r, nil
}

// parseObject scans body's top-level members (parseRequest's scanner,
// shared with the other wire formats through ParseWith).
func parseObject(body []byte) (*Request, *Error) {
	if !json.Valid(body) {
		return nil, parseError(CodeInvalidJSON, "", "the request body is not valid JSON")
	}
	i := skipWS(body, 0)
	if body[i] != '{' {
		return nil, parseError(CodeInvalidJSON, "", "the request body must be a JSON object")
	}
	r := &Request{body: body}
	i = skipWS(body, i+1)
	for body[i] != '}' {
		ks := i
		i = skipString(body, i)
		f := field{key: span{ks + 1, i - 1}}
		if bytes.IndexByte(body[ks+1:i-1], '\\') >= 0 {
			name, err := decodeKey(body[ks:i])
			if err != nil {
				return nil, parseError(CodeInvalidJSON, "", "the request body has an unreadable member name")
			}
			if r.names == nil {
				r.names = map[int]string{}
			}
			r.names[len(r.fields)] = name
		}
		i = skipWS(body, i)
		i = skipWS(body, i+1) // ':'
		vs := i
		i = skipValue(body, i)
		f.val = span{vs, i}
		if len(r.fields) == cap(r.fields) {
			// Doubling: append grows large slices by a quarter, copying
			// each member several times over.
			r.fields = slices.Grow(r.fields, max(len(r.fields), 8))
		}
		r.fields = append(r.fields, f)
		switch n := len(r.fields) - 1; {
		case n < indexAfter:
			for j := range n {
				if r.same(j, n) {
					return nil, r.duplicate(n)
				}
			}
		case n == indexAfter:
			// Many members: room for those still to come at the average
			// size of those so far (at most 32k more before append's
			// doubling takes over: a body of small members followed by one
			// large value reserves little).
			more := min((len(body)-i)/max(1, i/(n+1)), 1<<15)
			r.fields = slices.Grow(r.fields, more)
		}
		i = skipWS(body, i)
		if body[i] == ',' {
			i = skipWS(body, i+1)
		}
	}
	r.closing = i
	if j := r.buildIndex(); j >= 0 {
		return nil, r.duplicate(j)
	}
	return r, nil
}

func (r *Request) duplicate(j int) *Error {
	name := r.nameOf(j)
	return parseError(CodeInvalidJSON, name, "the request body has the member %q twice", name)
}

// nameOf returns the decoded name of fields[j].
func (r *Request) nameOf(j int) string {
	if name, ok := r.names[j]; ok {
		return name
	}
	k := r.fields[j].key
	return string(r.body[k.start:k.end])
}

// is reports whether fields[j] is named name.
func (r *Request) is(j int, name string) bool {
	if dec, ok := r.names[j]; ok {
		return dec == name
	}
	k := r.fields[j].key
	return string(r.body[k.start:k.end]) == name
}

// same reports whether fields[i] and fields[j] have the same decoded name.
func (r *Request) same(i, j int) bool {
	_, ei := r.names[i]
	_, ej := r.names[j]
	if !ei && !ej {
		a, b := r.fields[i].key, r.fields[j].key
		return bytes.Equal(r.body[a.start:a.end], r.body[b.start:b.end])
	}
	return r.nameOf(i) == r.nameOf(j)
}

func (r *Request) hash(j int) uint64 {
	if name, ok := r.names[j]; ok {
		return maphash.String(nameSeed, name)
	}
	k := r.fields[j].key
	return maphash.Bytes(nameSeed, r.body[k.start:k.end])
}

// buildIndex builds r.index past indexAfter members and returns the
// position of the first member (in body order) whose name an earlier
// member has, else -1: the member the scan of the first indexAfter
// members would have reported, had it gone on.
func (r *Request) buildIndex() int {
	n := len(r.fields)
	if n <= indexAfter {
		return -1
	}
	r.indexBits = uint(bits.Len(uint(n)))
	mask := uint64(1)<<r.indexBits - 1
	idx := make([]uint64, n)
	for j := range n {
		idx[j] = r.hash(j)&^mask | uint64(j)
	}
	sortIndex(idx)
	r.index = idx
	// Entries with one hash are adjacent, in body order. In each run,
	// every member repeating the name of an earlier one is a duplicate;
	// the first in body order is the answer.
	first := -1
	for k := 0; k < n; {
		end := k + 1
		for end < n && idx[end]&^mask == idx[k]&^mask {
			end++
		}
		for a := k + 1; a < end; a++ {
			pa := int(idx[a] & mask)
			if first >= 0 && pa > first {
				break // later in the body than the duplicate found
			}
			for b := k; b < a; b++ {
				if r.same(int(idx[b]&mask), pa) {
					first = pa
					break
				}
			}
		}
		k = end
	}
	return first
}

// sortIndex sorts idx in time linear in its length: a counting sort on the
// top bits into about len/2 buckets (the entries are hashes, so they
// spread evenly), then an insertion sort within each bucket.
func sortIndex(idx []uint64) {
	n := len(idx)
	if n < 1024 {
		slices.Sort(idx)
		return
	}
	b := uint(bits.Len(uint(n))) - 1 // about n/2 buckets
	shift := 64 - b
	start := make([]int32, 1<<b+1)
	for _, v := range idx {
		start[v>>shift+1]++
	}
	for k := 1; k < len(start); k++ {
		start[k] += start[k-1]
	}
	out := make([]uint64, n)
	next := slices.Clone(start[:1<<b])
	for _, v := range idx {
		out[next[v>>shift]] = v
		next[v>>shift]++
	}
	for k := range 1 << b {
		bucket := out[start[k]:start[k+1]]
		for i := 1; i < len(bucket); i++ {
			for j := i; j > 0 && bucket[j] < bucket[j-1]; j-- {
				bucket[j], bucket[j-1] = bucket[j-1], bucket[j]
			}
		}
	}
	copy(idx, out)
}

// lookup returns the position in fields of the member name.
func (r *Request) lookup(name string) (int, bool) {
	if r.index == nil {
		for j := range r.fields {
			if r.is(j, name) {
				return j, true
			}
		}
		return 0, false
	}
	mask := uint64(1)<<r.indexBits - 1
	tag := maphash.String(nameSeed, name) &^ mask
	for k, _ := slices.BinarySearch(r.index, tag); k < len(r.index) && r.index[k]&^mask == tag; k++ {
		if j := int(r.index[k] & mask); r.is(j, name) {
			return j, true
		}
	}
	return 0, false
}

// value returns the raw value of a top-level member, nil if absent.
func (r *Request) value(name string) []byte {
	if s, ok := r.span(name); ok {
		return r.body[s.start:s.end]
	}
	return nil
}

func (r *Request) span(name string) (span, bool) {
	if j, ok := r.lookup(name); ok {
		return r.fields[j].val, true
	}
	return span{}, false
}

func isNull(v []byte) bool { return v == nil || string(v) == "null" }

func (r *Request) interpret() *Error {
	if e := r.interpretModel(); e != nil {
		return e
	}
	return r.interpretOpenAI()
}

// interpretModel reads "model" (every wire format names its model so).
func (r *Request) interpretModel() *Error {
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
	return nil
}

// interpretOpenAI reads the Chat Completions, Completions and Embeddings
// members.
func (r *Request) interpretOpenAI() *Error {
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
	return r.interpretSampling()
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
func (r *Request) has(path string) bool {
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
// not ask for it). The client's own "priority" member is always removed;
// with priority set, "priority" is the engine priority the proxy chose
// (the traffic class's, docs/traffic.md). Every other byte is the
// client's.
func (r *Request) rewrite(upstreamModel string, priority *int32) []byte {
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
	if r.stream && !r.includeUsage && !r.foreign {
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
	if j, ok := r.lookup("priority"); ok {
		// The member with its separator: up to the next member's opening
		// quote, or (the last member) from the end of the previous value.
		f := r.fields[j]
		switch {
		case j+1 < len(r.fields):
			ss = append(ss, splice{span{f.key.start - 1, r.fields[j+1].key.start - 1}, nil})
		case j > 0:
			ss = append(ss, splice{span{r.fields[j-1].val.end, f.val.end}, nil})
		default:
			ss = append(ss, splice{span{f.key.start - 1, f.val.end}, nil})
		}
	}
	if priority != nil {
		sep := ","
		if len(r.fields) == 0 || (len(r.fields) == 1 && r.is(0, "priority")) {
			sep = ""
		}
		ss = append(ss, splice{span{r.closing, r.closing}, []byte(sep + `"priority":` + strconv.FormatInt(int64(*priority), 10))})
	}
	if len(ss) == 0 {
		return r.body
	}
	slices.SortStableFunc(ss, func(a, b splice) int { return a.at.start - b.at.start })
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
