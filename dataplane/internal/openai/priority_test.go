package openai

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRewritePriority: a client's "priority" member is always removed
// (wherever it is), and the proxy's is set only when given.
func TestRewritePriority(t *testing.T) {
	t.Parallel()
	p := int32(10)
	for _, tc := range []struct {
		name, in string
		prio     *int32
		want     string
	}{
		{"none, none sent", `{"model":"a","n":1}`, nil, `{"model":"up","n":1}`},
		{"none, set", `{"model":"a","n":1}`, &p, `{"model":"up","n":1,"priority":10}`},
		{"first removed", `{"priority":-50, "model":"a","n":1}`, nil, `{"model":"up","n":1}`},
		{"middle removed", `{"model":"a","priority":-50,"n":1}`, nil, `{"model":"up","n":1}`},
		{"last removed", `{"model":"a","n":1 , "priority" : -50 }`, nil, `{"model":"up","n":1 }`},
		{"replaced", `{"model":"a","priority":-50,"n":1}`, &p, `{"model":"up","n":1,"priority":10}`},
		{"with stream options", `{"model":"a","stream":true,"priority":-5}`, &p,
			`{"model":"up","stream":true,"stream_options":{"include_usage":true},"priority":10}`},
		{"other case kept", `{"model":"a","Priority":-5}`, nil, `{"model":"up","Priority":-5}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, e := parseRequest([]byte(tc.in))
			require.Nil(t, e)
			got := r.rewrite("up", tc.prio)
			require.Equal(t, tc.want, string(got))
			require.True(t, json.Valid(got), "%s", got)
		})
	}
}
