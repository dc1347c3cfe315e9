package openai

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestEngineMessageShapes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ body, msg, param string }{
		{`{"error":{"message":"too long","type":"BadRequestError","param":"max_tokens","code":400}}`, "too long", "max_tokens"},
		{`{"error":{"message":"odd param","param":"a b"}}`, "odd param", ""},
		{`{"error":"Unauthorized"}`, "Unauthorized", ""},
		{`{"object":"error","message":"old shape"}`, "old shape", ""},
		{`{"detail":"Not Found"}`, "Not Found", ""},
		{`{"detail":[{"loc":["body","n"],"msg":"bad","input":"x"},{"loc":["query"],"msg":"worse"}]}`, "n: bad; query: worse", "n"},
		{`<html>proxy error at 10.0.0.7</html>`, "", ""},
		{`{"unrelated":1}`, "", ""},
	} {
		msg, param := engineMessage([]byte(tc.body))
		require.Equal(t, tc.msg, msg, tc.body)
		require.Equal(t, tc.param, param, tc.body)
	}
}
