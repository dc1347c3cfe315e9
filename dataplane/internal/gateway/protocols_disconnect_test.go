package gateway

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestClientDisconnectEveryProtocol: on /v1/messages and /v1/responses as
// on chat (TestClientDisconnect), a client leaving mid-stream cancels the
// upstream request (the engine counts an abort) and the request is
// recorded once, as a 499 charged for the tokens the engine produced.
func TestClientDisconnectEveryProtocol(t *testing.T) {
	t.Parallel()
	sim := startSim(t, func(c *vllmsim.Config) { c.TimeScale, c.MeanOutputTokens = 1, 4000 }) // ~10 ms per token
	e := newEnv(t)
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("d1", "g", sim.URL()+"/v1", func(d *configv1.Deployment) {
		d.Capabilities = &configv1.Capabilities{Protocols: []string{"anthropic_messages", "openai_responses"}}
	})
	e.apply()

	for i, c := range []struct{ route, body string }{
		{RouteMessages, `{"model":"g","max_tokens":3000,"stream":true,"messages":[{"role":"user","content":"go on"}]}`},
		{RouteResponses, `{"model":"g","max_output_tokens":3000,"stream":true,"input":"go on"}`},
	} {
		t.Run(strings.TrimPrefix(c.route, "/v1/"), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.srv.URL+c.route, strings.NewReader(c.body))
			require.NoError(t, err)
			req.Header.Set("Authorization", "Bearer "+tok)
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, resp.StatusCode)
			id := resp.Header.Get(oai.RequestIDHeader)
			buf := make([]byte, 4096)
			for read := 0; read < 3000; { // a few events
				n, err := resp.Body.Read(buf)
				require.NoError(t, err)
				read += n
			}
			cancel()
			_ = resp.Body.Close()
			waitFor(t, "the engine to abort the request", func() bool { return sim.Stats().FinishedAbort == uint64(i+1) })
			ev := e.sink.byID(t, id) // exactly one event for the request
			require.Equal(t, c.route, ev.Route)
			require.Equal(t, int32(oai.StatusClientClosed), ev.Status)
			require.Equal(t, oai.CodeClientClosed, ev.ErrorCode)
			require.Positive(t, ev.PromptTokens)
			require.Positive(t, ev.CompletionTokens)
			require.Less(t, ev.CompletionTokens, int64(3000))
			require.Positive(t, ev.CostUsd)
		})
	}
}
