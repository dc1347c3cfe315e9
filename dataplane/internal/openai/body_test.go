package openai

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// TestRewrite: only model and stream_options change; every other byte is
// the client's, in its order and spacing.
func TestRewrite(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, in, want string }{
		{"model only", `{"model":"a", "z":[1, 2],"b":{"x":"y"}}`, `{"model":"up", "z":[1, 2],"b":{"x":"y"}}`},
		{"stream adds stream_options", `{ "stream" : true , "model" : "a" }`, `{ "stream" : true , "model" : "up" ,"stream_options":{"include_usage":true}}`},
		{"stream_options merged", `{"model":"a","stream":true,"stream_options":{"continuous_usage_stats":true}}`,
			`{"model":"up","stream":true,"stream_options":{"continuous_usage_stats":true,"include_usage":true}}`},
		{"stream_options null", `{"stream_options":null,"model":"a","stream":true}`, `{"stream_options":{"include_usage":true},"model":"up","stream":true}`},
		{"client asked: untouched", `{"model":"a","stream":true,"stream_options":{"include_usage":true}}`, `{"model":"up","stream":true,"stream_options":{"include_usage":true}}`},
		{"escaped key", `{"mod\u0065l":"a"}`, `{"mod\u0065l":"up"}`},
		{"unicode kept", `{"model":"a","messages":[{"content":"h\u00e9 \"q\" ü"}]}`, `{"model":"up","messages":[{"content":"h\u00e9 \"q\" ü"}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, e := parseRequest([]byte(tc.in))
			require.Nil(t, e)
			require.Equal(t, "a", r.model)
			got := r.rewrite("up", nil)
			require.Equal(t, tc.want, string(got))
			require.True(t, json.Valid(got))
		})
	}
}

func TestParseFields(t *testing.T) {
	t.Parallel()
	r, e := parseRequest([]byte(`{"model":"m","stream":true,"max_tokens":5,"max_completion_tokens":9,
		"tools":[{"type":"function"}],"response_format":{"type":"json_schema"},
		"messages":[{"role":"user","content":[{"type":"text","text":"abcdefgh"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}`))
	require.Nil(t, e)
	require.True(t, r.stream)
	require.False(t, r.includeUsage)
	require.Equal(t, int64(9), r.maxTokens)
	require.Equal(t, "max_completion_tokens", r.maxTokensParam)
	require.True(t, r.tools)
	require.True(t, r.jsonMode)
	require.True(t, r.images)
	require.True(t, r.has("tools"))
	require.False(t, r.has("user"))

	r, e = parseRequest([]byte(`{"model":"m","tools":[],"response_format":{"type":"text"},"prompt":[1,2,3,4,5],"metadata":{"a":{"b":null,"c":1}}}`))
	require.Nil(t, e)
	require.False(t, r.tools)
	require.False(t, r.jsonMode)
	require.Equal(t, int64(5), r.promptEstimate)
	require.True(t, r.has("metadata.a.c"))
	require.False(t, r.has("metadata.a.b"))
	require.False(t, r.has("metadata.x"))
}

// FuzzParseRequest: any input either parses (and the rewrite is valid JSON
// naming the new model) or is refused with a 400; never a panic.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{`{"model":"a"}`, `{"model":"a","stream":true}`, `{"mod\u0065l":"a","stream_options":{}}`,
		`{"model":"a","messages":[{"content":[{"type":"image_url"}]}]}`, `[]`, `{"model":"a","model":"b"}`, `  {"model" : "a" , "x":[{},[]]}  `,
		string(membersBody(40, "")), string(membersBody(40, `,"m\u0033":0`)), string(membersBody(1100, `,"m1099":0`))} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		r, e := parseRequest(body)
		// The duplicate check agrees with encoding/json's tokenizer (which
		// reads invalid UTF-8 in names as U+FFFD, where the proxy compares
		// bytes: only valid JSON in valid UTF-8 is compared).
		if name, dup, ok := firstDuplicate(t, body); ok && json.Valid(body) && utf8.Valid(body) {
			switch {
			case dup && (e == nil || e.Param != name || !strings.HasSuffix(e.Message, "twice")):
				t.Fatalf("%q: the member %q twice, parse answered %v", body, name, e)
			case !dup && e != nil && strings.HasSuffix(e.Message, "twice"):
				t.Fatalf("%q: no duplicate, parse answered %v", body, e)
			}
		}
		if e != nil {
			if e.Status != 400 {
				t.Fatalf("status %d", e.Status)
			}
			return
		}
		out := r.rewrite("upstream/model", nil)
		if !json.Valid(out) {
			t.Fatalf("rewrite of %q is not JSON: %q", body, out)
		}
		var m map[string]any
		if json.Unmarshal(out, &m) == nil && m["model"] != "upstream/model" {
			t.Fatalf("rewrite of %q: model %v", body, m["model"])
		}
	})
}

// The fast paths decode and encode exactly as encoding/json does.
func TestFastPathsMatchEncodingJSON(t *testing.T) {
	for _, s := range []string{"", "bench", "meta-llama/Llama-3.1-8B", "a<b>&c", `q"uote`, `back\slash`, "tab\t", "é", "\u2028", "\x7f"} {
		want, _ := json.Marshal(s)
		require.Equal(t, string(want), string(quote(s)), "quote(%q)", s)
		var dec string
		require.NoError(t, json.Unmarshal(want, &dec))
		if got, ok := plainString(want); ok {
			require.Equal(t, dec, got, "plainString(%s)", want)
		}
	}
	for _, v := range []string{"0", "7", "128", "999999999999999999", "1e3", "1.0", "-1", "9999999999999999999"} {
		var want int64
		wantErr := json.Unmarshal([]byte(v), &want)
		if got, ok := plainInt([]byte(v)); ok {
			require.NoError(t, wantErr, v)
			require.Equal(t, want, got, v)
		}
	}
	for _, c := range []struct{ body, want string }{
		{`{"id":"x","usage":{"prompt_tokens":1}}`, `{"prompt_tokens":1}`},
		{`{"Usage":{"prompt_tokens":2}}`, `{"prompt_tokens":2}`},
		{`{"us\u0061ge":{"prompt_tokens":3}, "x":[1,{"usage":4}]}`, `{"prompt_tokens":3}`},
		{`{"usage":1,"usage":{"a":5}}`, `{"a":5}`},
		{`{"choices":[{"text":"\"usage\":9"}]}`, ``},
		{`[{"usage":{}}]`, ``},
	} {
		require.True(t, json.Valid([]byte(c.body)))
		require.Equal(t, c.want, string(memberValue([]byte(c.body), "usage")), c.body)
	}
}

func TestModelMustBeUTF8(t *testing.T) {
	_, e := parseRequest([]byte(`{"model":"a\u0000b"}`))
	require.NotNil(t, e)
	require.Equal(t, CodeInvalidParameter, e.Code)
	require.Equal(t, "model", e.Param)
	// Invalid UTF-8 is decoded as U+FFFD: the ledger can take it.
	r, e := parseRequest([]byte("{\"model\":\"a\xffb\"}"))
	require.Nil(t, e)
	require.Equal(t, "a\uFFFDb", r.model)
}
