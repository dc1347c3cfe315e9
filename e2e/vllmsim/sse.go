package vllmsim

import (
	"strconv"
	"unicode/utf8"
)

// appendJSONString appends s to b as a JSON string literal.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && size == 1 {
				b = append(b, s[start:i]...)
				b = append(b, `\ufffd`...)
				i += size
				start = i
				continue
			}
			if r == '\u2028' || r == '\u2029' {
				b = append(b, s[start:i]...)
				b = append(b, `\u202`...)
				b = append(b, hex[r&0xf])
				i += size
				start = i
				continue
			}
			i += size
			continue
		}
		if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
			i++
			continue
		}
		b = append(b, s[start:i]...)
		switch c {
		case '"', '\\':
			b = append(b, '\\', c)
		case '\n':
			b = append(b, '\\', 'n')
		case '\r':
			b = append(b, '\\', 'r')
		case '\t':
			b = append(b, '\\', 't')
		default:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		}
		i++
		start = i
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// chunkWriter builds the SSE chunks of one streaming response by hand: the
// per-token path must not go through reflection.
type chunkWriter struct {
	chat            bool   // chat.completion.chunk, else text_completion
	prefix          []byte // `data: {"id":...,"model":...,"choices":[`
	continuousUsage bool
	promptTokens    int
}

func newChunkWriter(chat bool, id, model string, created int64, promptTokens int, continuousUsage bool) *chunkWriter {
	obj := "text_completion"
	if chat {
		obj = "chat.completion.chunk"
	}
	p := []byte(`data: {"id":`)
	p = appendJSONString(p, id)
	p = append(p, `,"object":"`...)
	p = append(p, obj...)
	p = append(p, `","created":`...)
	p = strconv.AppendInt(p, created, 10)
	p = append(p, `,"model":`...)
	p = appendJSONString(p, model)
	p = append(p, `,"choices":[`...)
	return &chunkWriter{chat: chat, prefix: p, continuousUsage: continuousUsage, promptTokens: promptTokens}
}

// role appends the chat stream's first chunk of a choice.
func (w *chunkWriter) role(b []byte, index, completionTokens int) []byte {
	b = append(b, w.prefix...)
	b = append(b, `{"index":`...)
	b = strconv.AppendInt(b, int64(index), 10)
	b = append(b, `,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]`...)
	return w.end(b, completionTokens)
}

// token appends a chunk carrying text (possibly empty) and, when finish is
// set, the choice's finish reason.
func (w *chunkWriter) token(b []byte, index int, text string, finish FinishReason, completionTokens int) []byte {
	b = append(b, w.prefix...)
	b = append(b, `{"index":`...)
	b = strconv.AppendInt(b, int64(index), 10)
	if w.chat {
		if text == "" && finish != "" {
			b = append(b, `,"delta":{}`...)
		} else {
			b = append(b, `,"delta":{"content":`...)
			b = appendJSONString(b, text)
			b = append(b, '}')
		}
	} else {
		b = append(b, `,"text":`...)
		b = appendJSONString(b, text)
	}
	b = append(b, `,"logprobs":null,"finish_reason":`...)
	if finish == "" {
		b = append(b, `null`...)
	} else {
		b = appendJSONString(b, string(finish))
	}
	b = append(b, `,"stop_reason":null}]`...)
	return w.end(b, completionTokens)
}

func (w *chunkWriter) end(b []byte, completionTokens int) []byte {
	if w.continuousUsage {
		b = append(b, `,"usage":`...)
		b = appendUsage(b, w.promptTokens, completionTokens, -1)
	}
	return append(b, "}\n\n"...)
}

// usage appends the final usage chunk (choices empty).
func (w *chunkWriter) usage(b []byte, completionTokens, cachedTokens int) []byte {
	b = append(b, w.prefix...)
	b = append(b, `],"usage":`...)
	b = appendUsage(b, w.promptTokens, completionTokens, cachedTokens)
	return append(b, "}\n\n"...)
}

// appendUsage appends an OpenAI usage object; cached < 0 omits the prompt
// tokens details, as does a cache miss.
func appendUsage(b []byte, prompt, completion, cached int) []byte {
	b = append(b, `{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(prompt), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(prompt+completion), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(completion), 10)
	if cached > 0 {
		b = append(b, `,"prompt_tokens_details":{"cached_tokens":`...)
		b = strconv.AppendInt(b, int64(cached), 10)
		b = append(b, '}')
	}
	return append(b, '}')
}

var doneEvent = []byte("data: [DONE]\n\n")
