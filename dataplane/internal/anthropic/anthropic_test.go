package anthropic

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

func TestParseMessages(t *testing.T) {
	r, e := ParseMessages([]byte(`{"model":"claude","max_tokens":64,"stream":true,"system":"be brief",
		"messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}}]}],
		"tools":[{"name":"t","input_schema":{"type":"object"}}],"tool_choice":{"type":"auto"}}`))
	if e != nil {
		t.Fatal(e)
	}
	if r.Model() != "claude" || !r.Stream() || r.MaxTokens() != 64 || r.MaxTokensParam() != "max_tokens" || !r.Tools() || !r.Images() {
		t.Fatalf("read %+v", r)
	}
	if r.PromptEstimate() < imageTokens {
		t.Fatalf("estimate %d misses the image", r.PromptEstimate())
	}
	if !r.IncludeUsage() || r.OutputChoices() != 1 {
		t.Fatal("foreign bodies strip nothing and generate one sequence")
	}
	if got := string(r.Rewrite("up")); !strings.HasPrefix(got, `{"model":"up",`) || strings.Contains(got, "stream_options") {
		t.Fatalf("rewrite %s", got)
	}
	for _, tc := range []struct{ body, code, param string }{
		{`{"model":"c","messages":[]}`, openai.CodeMissingRequiredParam, "max_tokens"},
		{`{"model":"c","max_tokens":0,"messages":[]}`, openai.CodeInvalidParameter, "max_tokens"},
		{`{"model":"c","max_tokens":1}`, openai.CodeMissingRequiredParam, "messages"},
		{`{"model":"c","max_tokens":1,"messages":{}}`, openai.CodeInvalidParameter, "messages"},
		{`{"model":"c","max_tokens":1,"messages":[1]}`, openai.CodeInvalidParameter, "messages"},
		{`{"model":"c","max_tokens":1,"messages":[],"system":3}`, openai.CodeInvalidParameter, "system"},
		{`{"model":"c","max_tokens":1,"messages":[],"tools":{}}`, openai.CodeInvalidParameter, "tools"},
		{`{"model":"c","max_tokens":1,"messages":[],"stream":"yes"}`, openai.CodeInvalidParameter, "stream"},
		{`{"max_tokens":1,"messages":[]}`, openai.CodeMissingRequiredParam, "model"},
		{`{"model":"c","model":"d","max_tokens":1,"messages":[]}`, openai.CodeInvalidParameter, ""},
	} {
		_, e := ParseMessages([]byte(tc.body))
		if e == nil || e.Code != tc.code && tc.param != "" || e.Param != tc.param && tc.param != "" {
			t.Errorf("%s: %+v, want %s %s", tc.body, e, tc.code, tc.param)
		}
	}
}

func TestErrorShape(t *testing.T) {
	for _, tc := range []struct {
		e   *openai.Error
		typ string
	}{
		{openai.Unauthorized(openai.CodeInvalidAPIKey, "x"), TypeAuthentication},
		{openai.Forbidden(openai.CodeModelNotAllowed, "model", "x"), TypePermission},
		{openai.ModelNotFound("m"), TypeNotFound},
		{openai.InvalidRequest(openai.CodeInvalidJSON, "", "x"), TypeInvalidRequest},
		{&openai.Error{Status: 429, Code: openai.CodeRateLimitExceeded}, TypeRateLimit},
		{&openai.Error{Status: 429, Code: openai.CodeBudgetExceeded}, TypeRateLimit},
		{openai.Unavailable(openai.CodeOverloaded, "x", time.Second), TypeOverloaded},
		{openai.Unavailable(openai.CodeLimitsUnavailable, "x", time.Second), TypeOverloaded},
		{openai.Upstream(openai.CodeUpstreamError, "x"), TypeAPI},
		{&openai.Error{Status: 500, Code: openai.CodeInternal}, TypeAPI},
		{&openai.Error{Status: 413, Code: openai.CodeRequestTooLarge}, TypeRequestTooLarge},
		{&openai.Error{Status: 504, Code: openai.CodeUpstreamTimeout}, TypeTimeout},
	} {
		if got := ErrorType(tc.e); got != tc.typ {
			t.Errorf("%s (%d): %s, want %s", tc.e.Code, tc.e.Status, got, tc.typ)
		}
	}
	w := httptest.NewRecorder()
	WriteError(w, &openai.Error{Status: 429, Type: openai.TypeRateLimit, Code: openai.CodeRateLimitExceeded, Message: "slow down", RetryAfter: 1500 * time.Millisecond})
	if w.Code != 429 || w.Header().Get("Retry-After") != "2" || w.Header().Get("Retry-After-Ms") != "1500" {
		t.Fatalf("%d %v", w.Code, w.Header())
	}
	want := `{"type":"error","error":{"type":"rate_limit_error","message":"slow down","code":"rate_limit_exceeded"}}` + "\n"
	if w.Body.String() != want {
		t.Fatalf("body %s", w.Body)
	}
	if ev := string(ErrorEvent(openai.Upstream(openai.CodeUpstreamStreamError, "cut"))); !strings.HasPrefix(ev, "event: error\ndata: {\"type\":\"error\"") || !strings.HasSuffix(ev, "\n\n") {
		t.Fatalf("event %q", ev)
	}
}

func TestRateHeaders(t *testing.T) {
	hd := http.Header{}
	hd.Set("X-Ratelimit-Limit-Requests", "10")
	hd.Set("X-Ratelimit-Remaining-Requests", "9")
	hd.Set("X-Ratelimit-Reset-Requests", "6s")
	hd.Set("X-Ratelimit-Reset-Tokens", "20ms")
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	AddRateHeaders(hd, now)
	if hd.Get("Anthropic-Ratelimit-Requests-Limit") != "10" || hd.Get("Anthropic-Ratelimit-Requests-Remaining") != "9" ||
		hd.Get("Anthropic-Ratelimit-Requests-Reset") != "2026-01-02T03:04:11Z" || hd.Get("Anthropic-Ratelimit-Tokens-Reset") != "2026-01-02T03:04:05Z" {
		t.Fatalf("%v", hd)
	}
	if hd.Get("X-Ratelimit-Limit-Requests") != "10" {
		t.Fatal("the OpenAI names stay")
	}
}

func TestStreamUsage(t *testing.T) {
	var s Stream
	evs := []string{
		"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":10,\"cache_read_input_tokens\":30,\"cache_creation_input_tokens\":5,\"output_tokens\":1}}}\n\n",
		"event: ping\ndata: {\"type\":\"ping\"}\n\n",
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n",
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":7}}\n\n",
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
	}
	var last *openai.Usage
	var text, done int
	for _, ev := range evs {
		e := s.Event([]byte(ev))
		if e.Usage != nil {
			last = e.Usage
		}
		if e.Text {
			text++
		}
		if e.Done {
			done++
		}
	}
	if last == nil || last.PromptTokens != 45 || last.CompletionTokens != 7 || last.CachedTokens() != 30 || last.CacheCreationTokens != 5 {
		t.Fatalf("usage %+v", last)
	}
	if text != 1 || done != 1 {
		t.Fatalf("text %d done %d", text, done)
	}
	if e := s.Event([]byte("event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\"}}\n\n")); !e.Error {
		t.Fatal("error event")
	}
	u := BodyUsage([]byte(`{"id":"m","usage":{"input_tokens":3,"output_tokens":4,"cache_read_input_tokens":2}}`))
	if u == nil || u.PromptTokens != 5 || u.CompletionTokens != 4 || u.CachedTokens() != 2 {
		t.Fatalf("body usage %+v", u)
	}
	if BodyUsage([]byte(`{"usage":{}}`)) != nil || BodyUsage([]byte(`nope`)) != nil {
		t.Fatal("no usage")
	}
}

func FuzzParseMessages(f *testing.F) {
	f.Add([]byte(`{"model":"c","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`))
	f.Add([]byte(`{"model":"c","max_tokens":5,"messages":[{"role":"user","content":[{"type":"image"}]}],"system":[{"type":"text","text":"s"}]}`))
	f.Add([]byte(`{"model":"c","max_tokens":5,"messages":[],"tools":[],"tool_choice":{"type":"any"}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, e := ParseMessages(b)
		if (r == nil) == (e == nil) {
			t.Fatal("exactly one of request and error")
		}
		if r != nil && (r.MaxTokens() < 1 || r.PromptEstimate() < 0 || r.Model() == "") {
			t.Fatalf("accepted %q: %+v", b, r)
		}
	})
}

func FuzzStream(f *testing.F) {
	f.Add([]byte("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":1}}}\n\n"))
	f.Add([]byte("data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":-3}}\n\n"))
	f.Add([]byte("data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\"}}\n"))
	f.Add([]byte("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"x\"}}\n\n"))
	f.Add([]byte("event: ping\ndata: {\"type\":\"ping\"}\n\n"))
	f.Add([]byte("data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"signature\\u005fdelta\"}}\n\n"))
	f.Add([]byte("data: {\"type\":\"content_block_delta\",\"delta\":\"x\",\"usage\":1}\n\n"))
	f.Add([]byte("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":12,\"delta\":{\"type\":\"text_delta\",\"text\":\"a\\\"b\\u00e9\\n\"}}\n\n"))
	f.Add([]byte("data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"city\\\": \"}}\n\n"))
	f.Add([]byte("data: {\"type\":\"content_block_stop\",\"index\":0}\n\n"))
	f.Add([]byte(`{"usage":{"input_tokens":3,"output_tokens":null,"cache_read_input_tokens":2,"Cache_Creation_Input_Tokens":1}}`))
	f.Add([]byte(`{"usage":{"input_tokens":-3,"output_tokens":1e2}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var s Stream
		for range 2 {
			if e := s.Event(b); e.Usage != nil && (e.Usage.PromptTokens < 0 || e.Usage.CompletionTokens < 0 || e.Usage.CachedTokens() > e.Usage.PromptTokens) {
				t.Fatalf("usage %+v", e.Usage)
			}
		}
		if u := BodyUsage(b); u != nil && (u.PromptTokens < 0 || u.CompletionTokens < 0) {
			t.Fatalf("body usage %+v", u)
		}
		// The undecoded usage reads what decoding would.
		if json.Valid(b) {
			if v := openai.MemberValue(b, "usage"); !openai.IsNull(v) {
				if fast, ok := plainUsage(v); ok {
					var u Usage
					var slow *openai.Usage
					if json.Unmarshal(v, &u) == nil && (u.InputTokens != nil || u.OutputTokens != nil) {
						slow = u.OpenAI()
					}
					if (fast == nil) != (slow == nil) || fast != nil && (*fast.PromptTokensDetails != *slow.PromptTokensDetails ||
						fast.PromptTokens != slow.PromptTokens || fast.CompletionTokens != slow.CompletionTokens || fast.CacheCreationTokens != slow.CacheCreationTokens) {
						t.Fatalf("%q: plain usage %+v, decoded %+v", v, fast, slow)
					}
				}
			}
		}
		// The fast paths answer what decoding would.
		if name, data := fields(b); data != nil {
			if fast, ok := compactEvent(data); ok {
				if !json.Valid(data) {
					t.Fatalf("%q: compact but not valid JSON", data)
				}
				var s2 Stream
				if slow := s2.decode(string(name), data); fast != slow {
					t.Fatalf("%q: compact %+v, decoded %+v", b, fast, slow)
				}
			}
			if fast, ok := fastEvent(data); ok {
				var s2 Stream
				if slow := s2.decode(string(name), data); fast != slow {
					t.Fatalf("%q: fast %+v, decoded %+v", b, fast, slow)
				}
			}
		}
	})
}

func TestFields(t *testing.T) {
	ev := []byte("event: message_delta\r\ndata: {\"a\":\ndata: 1}\n\n")
	orig := string(ev)
	name, data := fields(ev)
	if string(name) != "message_delta" || string(data) != "{\"a\":\n1}" {
		t.Fatalf("name %q data %q", name, data)
	}
	if string(ev) != orig {
		t.Fatalf("fields wrote into the event: %q", ev)
	}
	if _, data := fields([]byte("event: ping\n\n")); data != nil {
		t.Fatalf("no data line: %q", data)
	}
	if e := (&Stream{}).Event([]byte("event: message_delta\ndata: {\"type\":\"message_delta\",\ndata: \"usage\":{\"output_tokens\":3}}\n\n")); e.Usage == nil || e.Usage.CompletionTokens != 3 {
		t.Fatalf("usage over two data lines: %+v", e.Usage)
	}
}
