package openai

import (
	"math"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestParseSampling: n, best_of and the prompts of a batch multiply the
// output; they must be positive integers, and the output cap they make
// with max_tokens must fit MaxEstimateTokens. Every refusal is a 400 naming
// the parameter.
func TestParseSampling(t *testing.T) {
	t.Parallel()
	const base = `"model":"m","messages":[{"role":"user","content":"hi"}]`
	for _, tc := range []struct {
		body    string
		choices int64
		param   string
	}{
		{`{` + base + `}`, 1, ""},
		{`{` + base + `,"n":null}`, 1, ""},
		{`{` + base + `,"n":1}`, 1, ""},
		{`{` + base + `,"n":3}`, 3, "n"},
		{`{` + base + `,"n":2,"best_of":5}`, 5, "best_of"},
		{`{` + base + `,"n":5,"best_of":2}`, 5, "n"},
		{`{"model":"m","prompt":["a","b","c"],"n":2}`, 6, "n"},
		{`{"model":"m","prompt":[[1,2],[3]]}`, 2, "prompt"},
		{`{"model":"m","prompt":[1,2,3]}`, 1, ""},
		{`{"model":"m","prompt":"one"}`, 1, ""},
		{`{"model":"m","prompt":[]}`, 1, ""},
		{`{"model":"m","prompt":[ "a" , "b" ]}`, 2, "prompt"},
		{`{` + base + `,"n":1000,"max_tokens":1000000000}`, 1000, "n"}, // 10^12: at the bound
	} {
		r, e := parseRequest([]byte(tc.body))
		require.Nil(t, e, tc.body)
		require.Equal(t, tc.choices, r.choices, tc.body)
		require.Equal(t, tc.param, r.choicesParam, tc.body)
	}
	for _, tc := range []struct{ body, code, param string }{
		{`{` + base + `,"n":0}`, CodeInvalidParameter, "n"},
		{`{` + base + `,"n":-2}`, CodeInvalidParameter, "n"},
		{`{` + base + `,"n":"3"}`, CodeInvalidParameter, "n"},
		{`{` + base + `,"n":2.5}`, CodeInvalidParameter, "n"},
		{`{` + base + `,"n":true}`, CodeInvalidParameter, "n"},
		{`{` + base + `,"n":99999999999999999999}`, CodeInvalidParameter, "n"},
		{`{` + base + `,"best_of":0}`, CodeInvalidParameter, "best_of"},
		{`{` + base + `,"max_tokens":9223372036854775807}`, CodeInvalidParameter, "max_tokens"},
		{`{` + base + `,"max_completion_tokens":9223372036854775807}`, CodeInvalidParameter, "max_completion_tokens"},
		{`{` + base + `,"max_tokens":1000000000001}`, CodeInvalidParameter, "max_tokens"},
		{`{` + base + `,"max_tokens":9223372036854775808}`, CodeInvalidParameter, "max_tokens"},
		{`{` + base + `,"n":1001,"max_tokens":1000000000}`, CodeEstimateTooLarge, "n"},
		{`{` + base + `,"n":4611686018427387904,"max_tokens":4}`, CodeEstimateTooLarge, "n"},
		{`{` + base + `,"n":9223372036854775807}`, CodeEstimateTooLarge, "n"},
		{`{` + base + `,"best_of":9223372036854775807,"max_tokens":2}`, CodeEstimateTooLarge, "best_of"},
		{`{"model":"m","prompt":["a","b"],"n":4611686018427387904}`, CodeEstimateTooLarge, "n"},
	} {
		_, e := parseRequest([]byte(tc.body))
		require.NotNil(t, e, tc.body)
		require.Equal(t, http.StatusBadRequest, e.Status, tc.body)
		require.Equal(t, TypeInvalidRequest, e.Type, tc.body)
		require.Equal(t, tc.code, e.Code, tc.body)
		require.Equal(t, tc.param, e.Param, tc.body)
		require.Contains(t, e.Message, tc.param, tc.body)
	}
}

func TestMulBounded(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		a, b, limit, want int64
		ok                bool
	}{
		{3, 4, 12, 12, true},
		{3, 4, 11, 0, false},
		{0, math.MaxInt64, 1, 0, true},
		{math.MaxInt64, 2, math.MaxInt64, 0, false},
		{1 << 32, 1 << 32, math.MaxInt64, 0, false},
		{-1, 2, 10, 0, false},
	} {
		got, ok := mulBounded(tc.a, tc.b, tc.limit)
		require.Equal(t, tc.ok, ok, "%d×%d", tc.a, tc.b)
		require.Equal(t, tc.want, got, "%d×%d", tc.a, tc.b)
	}
}
