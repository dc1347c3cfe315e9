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
	var u Usage
	if json.Unmarshal(v, &u) != nil || u.InputTokens == nil && u.OutputTokens == nil {
		return nil
	}
	return u.OpenAI()
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
	if e, ok := fastEvent(data); ok {
		return e
	}
	return s.decode(string(name), data)
}

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
