package openai

import (
	"encoding/json"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// unmarshalUsage is BodyUsage with encoding/json only (the reference the
// reflection-free path must agree with).
func unmarshalUsage(b []byte) *Usage {
	if !json.Valid(b) {
		return nil
	}
	v := memberValue(b, "usage")
	if isNull(v) {
		return nil
	}
	var u Usage
	if json.Unmarshal(v, &u) != nil {
		return nil
	}
	return &u
}

func TestBodyUsageAsEncodingJSON(t *testing.T) {
	cases := []string{
		`{"id":"x","choices":[{"message":{"content":"usage"}}],"usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}}`,
		`{"usage":{"prompt_tokens":10,"completion_tokens":20,"prompt_tokens_details":{"cached_tokens":4,"audio_tokens":0}}}`,
		`{"usage":{"prompt_tokens":10,"prompt_tokens_details":null}}`,
		`{"usage":{"prompt_tokens_details":{"cached_tokens":4},"prompt_tokens_details":{}}}`,
		`{"usage":{"prompt_tokens_details":{"cached_tokens":4},"prompt_tokens_details":null}}`,
		`{"usage":{"prompt_tokens":1,"prompt_tokens":null}}`,
		`{"usage":{"prompt_tokens":1,"prompt_tokens":2}}`,
		`{"usage":{"PROMPT_TOKENS":7,"Completion_Tokens":-3}}`,
		`{"usage":{"prompt_tokens":1.5}}`,
		`{"usage":{"prompt_tokens":1e3}}`,
		`{"usage":{"prompt_tokens":"5"}}`,
		`{"usage":{"prompt_tokens":true}}`,
		`{"usage":{"prompt_tokens":99999999999999999999}}`,
		`{"usage":{"prompt_tokens":999999999999999999}}`,
		`{"usage":{"prompt_tokens":-0}}`,
		`{"usage":{"prompt_tokens_details":5}}`,
		`{"usage":{"prompt_tokens_details":{"cached_tokens":"x"}}}`,
		`{"usage":{"prompt_\u0074okens":8}}`,
		`{"usage":{"prompt_tokenſ":8}}`,
		`{"usage":{}}`,
		`{"usage":null}`,
		`{"usage":[1,2]}`,
		`{"usage":3}`,
		`{"usage":"x"}`,
		`{"choices":[]}`,
		` { "usage" : { "prompt_tokens" : 3 , "completion_tokens" : 4 , "x" : {"a":[1,{"b":"}"}]} } } `,
		`not json`,
		`{"usage":{"prompt_tokens":3}`,
	}
	for _, c := range cases {
		require.Equal(t, unmarshalUsage([]byte(c)), BodyUsage([]byte(c)), "%s", c)
	}
	// Random usage objects from the members above.
	vals := []string{`0`, `1`, `-2`, `123456`, `null`, `1.0`, `"3"`, `{}`, `{"cached_tokens":5}`, `{"cached_tokens":null}`, `[]`, `false`}
	names := []string{`prompt_tokens`, `completion_tokens`, `prompt_tokens_details`, `total_tokens`, `Prompt_Tokens`, `cached_tokens`}
	r := rand.New(rand.NewPCG(1, 2))
	for range 5000 {
		var members []string
		for range r.IntN(5) {
			members = append(members, `"`+names[r.IntN(len(names))]+`":`+vals[r.IntN(len(vals))])
		}
		b := []byte(`{"id":"c","usage":{` + strings.Join(members, ",") + `}}`)
		require.Equal(t, unmarshalUsage(b), BodyUsage(b), "%s", b)
	}
}

func BenchmarkBodyUsage(b *testing.B) {
	ans := []byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"` +
		strings.Repeat("x", 300) + `"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30,"prompt_tokens_details":{"cached_tokens":2}}}`)
	b.Run("reflect", func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			if unmarshalUsage(ans) == nil {
				b.Fatal("no usage")
			}
		}
	})
	b.Run("fast", func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			if BodyUsage(ans) == nil {
				b.Fatal("no usage")
			}
		}
	})
}
