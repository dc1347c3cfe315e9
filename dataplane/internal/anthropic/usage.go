package anthropic

import (
	"bytes"
	"encoding/json"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

// Usage is Anthropic's usage object. Its input_tokens exclude the tokens
// read from and written to the prompt cache.
type Usage struct {
	InputTokens              *int64 `json:"input_tokens"`
	OutputTokens             *int64 `json:"output_tokens"`
	CacheReadInputTokens     *int64 `json:"cache_read_input_tokens"`
	CacheCreationInputTokens *int64 `json:"cache_creation_input_tokens"`
}

// merge sets the members u2 carries (a message_delta's usage is
// cumulative and may repeat or omit the input counts).
func (u *Usage) merge(u2 *Usage) {
	for _, p := range [...]struct {
		dst **int64
		src *int64
	}{
		{&u.InputTokens, u2.InputTokens}, {&u.OutputTokens, u2.OutputTokens},
		{&u.CacheReadInputTokens, u2.CacheReadInputTokens}, {&u.CacheCreationInputTokens, u2.CacheCreationInputTokens},
	} {
		if p.src != nil {
			v := *p.src
			*p.dst = &v
		}
	}
}

func val(p *int64) int64 {
	if p == nil || *p < 0 {
		return 0
	}
	return *p
}

// OpenAI returns u as Sluice accounts it: prompt tokens are input plus
// cache read plus cache creation tokens, cached tokens the cache reads
// (priced at the cached-input price), completion tokens the output.
func (u *Usage) OpenAI() *openai.Usage {
	read, created := val(u.CacheReadInputTokens), val(u.CacheCreationInputTokens)
	out := &openai.Usage{PromptTokens: val(u.InputTokens) + read + created, CompletionTokens: val(u.OutputTokens),
		CacheCreationTokens: created}
	out.PromptTokensDetails = &struct {
		CachedTokens int64 `json:"cached_tokens"`
	}{CachedTokens: read}
	return out
}

// BodyUsage reads the usage of a complete Message: nil when b is not a
// JSON object or carries none.
func BodyUsage(b []byte) *openai.Usage {
	if !json.Valid(b) {
		return nil
	}
	v := openai.MemberValue(b, "usage")
	if openai.IsNull(v) {
		return nil
	}
	if u, ok := plainUsage(v); ok {
		return u
	}
	var u Usage
	if json.Unmarshal(v, &u) != nil || u.InputTokens == nil && u.OutputTokens == nil {
		return nil
	}
	return u.OpenAI()
}

// usageMembers are the members of a usage object Sluice reads.
var usageMembers = [...]string{"input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}

// plainUsage reads a usage object (a member of a valid JSON object) whose
// counts are plain non-negative integers or null, as decoding it into
// Usage would, without decoding: ok is false for anything else (a
// negative or fractional count, a usage that is not an object), which
// BodyUsage then decodes.
func plainUsage(v []byte) (u *openai.Usage, ok bool) {
	if v[0] != '{' {
		return nil, false
	}
	var n [len(usageMembers)]int64
	var set [len(usageMembers)]bool
	for i, name := range usageMembers {
		var e *openai.Error
		if n[i], set[i], e = openai.NonNegativeInt(openai.MemberValue(v, name), name); e != nil {
			return nil, false
		}
	}
	if !set[0] && !set[1] {
		return nil, true
	}
	out := &openai.Usage{PromptTokens: n[0] + n[2] + n[3], CompletionTokens: n[1], CacheCreationTokens: n[3]}
	out.PromptTokensDetails = &struct {
		CachedTokens int64 `json:"cached_tokens"`
	}{CachedTokens: n[2]}
	return out, true
}

// Stream reads the events of one streamed Message as they are relayed:
// the usage of message_start (input and cache counts) merged with the
// cumulative usage of each message_delta.
type Stream struct {
	usage Usage
	seen  bool
}

var (
	dataPrefix  = []byte("data:")
	eventPrefix = []byte("event:")
)

// Event reads one SSE event (as openai.EventReader returns it): Done at
// message_stop, Error for an error event, Usage (cumulative so far) when
// the event carries usage, Text for a content_block_delta with text,
// JSON or thinking.
func (s *Stream) Event(ev []byte) openai.Event {
	name, data := fields(ev)
	if data == nil {
		return openai.Event{NoData: true}
	}
	if e, ok := compactEvent(data); ok {
		return e
	}
	if e, ok := fastEvent(data); ok {
		return e
	}
	return s.decode(string(name), data)
}

var (
	compactDeltaHead = []byte(`{"type":"content_block_delta","index":`)
	compactStopHead  = []byte(`{"type":"content_block_stop","index":`)
	compactPing      = []byte(`{"type":"ping"}`)
	// compactDeltas are the delta kinds whose one member is their text:
	// the text of a text delta, the partial JSON of a tool_use input, the
	// thinking of a thinking block.
	compactDeltas = [...][]byte{
		[]byte(`,"delta":{"type":"text_delta","text":`),
		[]byte(`,"delta":{"type":"input_json_delta","partial_json":`),
		[]byte(`,"delta":{"type":"thinking_delta","thinking":`),
	}
)

// compactEvent reads, without json.Valid or member scans, the events that
// make up nearly all of a stream when they come as Anthropic's API and
// vLLM write them: exactly {"type":"content_block_delta","index":N,
// "delta":{"type":"text_delta","text":"…"}} (or an input_json_delta's
// partial_json, a thinking_delta's thinking), {"type":"ping"} and
// {"type":"content_block_stop","index":N}, no space, no other member. That
// grammar is checked to its last byte (the string literal included), so
// such data is valid JSON with one type, no usage and no duplicate member,
// and the answer is the decoding's (FuzzStream checks it). ok is false for
// any other data, which fastEvent or the decoding then reads.
func compactEvent(data []byte) (e openai.Event, ok bool) {
	if bytes.Equal(data, compactPing) {
		return openai.Event{}, true
	}
	if rest, ok := bytes.CutPrefix(data, compactStopHead); ok {
		n := indexLen(rest)
		return openai.Event{}, n > 0 && string(rest[n:]) == "}"
	}
	rest, ok := bytes.CutPrefix(data, compactDeltaHead)
	if !ok {
		return openai.Event{}, false
	}
	n := indexLen(rest)
	if n == 0 {
		return openai.Event{}, false
	}
	rest = rest[n:]
	for _, head := range compactDeltas {
		if str, ok := bytes.CutPrefix(rest, head); ok {
			n := stringLen(str)
			return openai.Event{Text: true}, n > 0 && string(str[n:]) == "}}"
		}
	}
	return openai.Event{}, false
}

// indexLen is the length of the JSON integer (digits, no leading zero, at
// most 9) that b starts with, 0 if none.
func indexLen(b []byte) int {
	n := 0
	for n < len(b) && n < 10 && b[n] >= '0' && b[n] <= '9' {
		n++
	}
	if n == 10 || n > 1 && b[0] == '0' {
		return 0
	}
	return n
}

// stringLen is the length of the JSON string literal b starts with (as
// json.Valid accepts it: no raw control character, only JSON's escapes),
// 0 if b does not start with one.
func stringLen(b []byte) int {
	if len(b) == 0 || b[0] != '"' {
		return 0
	}
	for i := 1; i < len(b); i++ {
		switch c := b[i]; {
		case c == '"':
			return i + 1
		case c < 0x20:
			return 0
		case c == '\\':
			if i+1 >= len(b) {
				return 0
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i++
			case 'u':
				if i+5 >= len(b) || !isHex(b[i+2]) || !isHex(b[i+3]) || !isHex(b[i+4]) || !isHex(b[i+5]) {
					return 0
				}
				i += 5
			default:
				return 0
			}
		}
	}
	return 0
}

func isHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

// decode reads one event by decoding its data.
func (s *Stream) decode(name string, data []byte) openai.Event {
	var head struct {
		Type    string `json:"type"`
		Message *struct {
			Usage *Usage `json:"usage"`
		} `json:"message"`
		Usage *Usage `json:"usage"`
		Delta *struct {
			Type string `json:"type"`
		} `json:"delta"`
	}
	if json.Unmarshal(data, &head) != nil {
		return openai.Event{}
	}
	if head.Type == "" {
		head.Type = name
	}
	var out openai.Event
	switch head.Type {
	case "message_start":
		if head.Message != nil && head.Message.Usage != nil {
			s.usage.merge(head.Message.Usage)
			s.seen = true
		}
	case "message_delta":
		if head.Usage != nil {
			s.usage.merge(head.Usage)
			s.seen = true
		}
	case "content_block_delta":
		out.Text = head.Delta != nil && head.Delta.Type != "signature_delta"
	case "message_stop":
		out.Done = true
	case "error":
		out.Error = true
	}
	if s.seen && (head.Type == "message_start" || head.Type == "message_delta") {
		out.Usage = s.usage.OpenAI()
	}
	return out
}

var (
	typeContentBlockDelta = []byte(`"content_block_delta"`)
	typeSignatureDelta    = []byte(`"signature_delta"`)
	typePing              = []byte(`"ping"`)
	typeBlockStart        = []byte(`"content_block_start"`)
	typeBlockStop         = []byte(`"content_block_stop"`)
)

// fastEvent reads the events that carry no usage — the text deltas that
// make up most of a stream, pings, block starts and stops — without
// decoding them (the answer Event's full decoding would give: a delta
// has text unless it is a signature_delta; the others say nothing). ok is
// false for every other event, which Event then decodes.
func fastEvent(data []byte) (e openai.Event, ok bool) {
	if !json.Valid(data) {
		return openai.Event{}, false
	}
	typ := openai.MemberValue(data, "type")
	if typ == nil || openai.MemberValue(data, "usage") != nil || openai.MemberValue(data, "message") != nil {
		// No type (the event: line names it), or members the decoding
		// reads (and whose shape it checks): decode.
		return openai.Event{}, false
	}
	switch {
	case bytes.Equal(typ, typeContentBlockDelta):
		delta := openai.MemberValue(data, "delta")
		if len(delta) == 0 || delta[0] != '{' {
			return openai.Event{}, delta == nil || openai.IsNull(delta)
		}
		dt := openai.MemberValue(delta, "type")
		if bytes.IndexByte(dt, '\\') >= 0 || len(dt) > 0 && dt[0] != '"' && !openai.IsNull(dt) {
			return openai.Event{}, false // an escaped or non-string type: decode
		}
		return openai.Event{Text: !bytes.Equal(dt, typeSignatureDelta)}, true
	case bytes.Equal(typ, typePing), bytes.Equal(typ, typeBlockStart), bytes.Equal(typ, typeBlockStop):
		return openai.Event{}, true
	}
	return openai.Event{}, false
}

// fields returns an event's name (its event: line) and data (its data:
// lines joined by newlines, nil when it has none). A single data line is
// returned as a slice of ev (no copy: nothing keeps it past the event);
// several are joined in a new buffer.
func fields(ev []byte) (name []byte, data []byte) {
	copied := false
	for len(ev) > 0 {
		line := ev
		if i := bytes.IndexByte(ev, '\n'); i >= 0 {
			line, ev = ev[:i], ev[i+1:]
		} else {
			ev = nil
		}
		line = bytes.TrimSuffix(line, []byte{'\r'})
		switch {
		case bytes.HasPrefix(line, eventPrefix):
			name = bytes.TrimSpace(line[len(eventPrefix):])
		case bytes.HasPrefix(line, dataPrefix):
			d := line[len(dataPrefix):]
			if len(d) > 0 && d[0] == ' ' {
				d = d[1:]
			}
			switch {
			case data == nil:
				data = d[:len(d):len(d)] // an append must not write into ev
			case !copied:
				data, copied = append(append(append(make([]byte, 0, len(data)+1+len(d)), data...), '\n'), d...), true
			default:
				data = append(append(data, '\n'), d...)
			}
		}
	}
	return name, data
}
