package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"

	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// captureID is an option recording the answer's request id.
func captureID(dst *string) option.RequestOption {
	return option.WithMiddleware(func(r *http.Request, next option.MiddlewareNext) (*http.Response, error) {
		resp, err := next(r)
		if resp != nil {
			*dst = resp.Header.Get(oai.RequestIDHeader)
		}
		return resp, err
	})
}

// TestOpenAIClient drives the proxy with the official client: chat
// (streaming and not), completions, embeddings and models; the text and
// usage equal what the upstream gives for the same request, and each
// request is accounted once with its cost.
func TestOpenAIClient(t *testing.T) {
	t.Parallel()
	sim := startSim(t, nil)
	e := newEnv(t)
	tok := e.key("k1", func(k *configv1.Key) { k.ModelGroupAliases = map[string]string{"qwen": "qwen-30b"} })
	e.group("qwen-30b")
	e.group("hidden")
	e.deploy("d1", "qwen-30b", sim.URL()+"/v1", func(d *configv1.Deployment) {
		d.Prices.CachedInputPerToken = 5e-7
	})
	e.deploy("d2", "hidden", sim.URL()+"/v1", nil)
	e.snap.Keys[0].Limits = &configv1.Limits{AllowedModels: []string{"qwen-30b"}}
	e.apply()

	ctx := context.Background()
	viaProxy := openai.NewClient(option.WithBaseURL(e.srv.URL+"/v1"), option.WithAPIKey(tok), option.WithMaxRetries(0))
	direct := openai.NewClient(option.WithBaseURL(sim.URL()+"/v1"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	chat := func(model string) openai.ChatCompletionNewParams {
		return openai.ChatCompletionNewParams{Model: model, Seed: openai.Int(42), MaxTokens: openai.Int(24),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Tell the proxy test a short story.")}}
	}

	t.Run("chat", func(t *testing.T) {
		var id string
		got, err := viaProxy.Chat.Completions.New(ctx, chat("qwen"), captureID(&id))
		require.NoError(t, err)
		want, err := direct.Chat.Completions.New(ctx, chat(vllmsim.DefaultModel))
		require.NoError(t, err)
		require.Equal(t, want.Choices[0].Message.Content, got.Choices[0].Message.Content)
		require.NotEmpty(t, got.Choices[0].Message.Content)
		require.Equal(t, want.Usage.PromptTokens, got.Usage.PromptTokens)
		require.Equal(t, want.Usage.CompletionTokens, got.Usage.CompletionTokens)

		ev := e.sink.byID(t, id)
		require.Equal(t, int32(200), ev.Status)
		require.Equal(t, "qwen", ev.RequestedModel)
		require.Equal(t, "qwen-30b", ev.ModelGroup)
		require.Equal(t, "d1", ev.DeploymentId)
		require.Equal(t, "k1", ev.KeyId)
		require.Equal(t, got.Usage.PromptTokens, ev.PromptTokens)
		require.Equal(t, got.Usage.CompletionTokens, ev.CompletionTokens)
		cached := got.Usage.PromptTokensDetails.CachedTokens
		require.Equal(t, cached, ev.CachedTokens)
		wantCost := float64(got.Usage.PromptTokens-cached)*1e-6 + float64(cached)*5e-7 + float64(got.Usage.CompletionTokens)*2e-6
		require.InDelta(t, wantCost, ev.CostUsd, 1e-12)
		require.Equal(t, int32(1), ev.Attempts)
	})

	t.Run("chat stream", func(t *testing.T) {
		var id string
		params := chat("qwen")
		params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
		text := func(s interface {
			Next() bool
			Current() openai.ChatCompletionChunk
			Err() error
		}) (string, openai.CompletionUsage) {
			var b strings.Builder
			var u openai.CompletionUsage
			for s.Next() {
				c := s.Current()
				if len(c.Choices) > 0 {
					b.WriteString(c.Choices[0].Delta.Content)
				}
				if c.Usage.TotalTokens > 0 {
					u = c.Usage
				}
			}
			require.NoError(t, s.Err())
			return b.String(), u
		}
		got, gotUsage := text(viaProxy.Chat.Completions.NewStreaming(ctx, params, captureID(&id)))
		params.Model = vllmsim.DefaultModel
		want, wantUsage := text(direct.Chat.Completions.NewStreaming(ctx, params))
		require.NotEmpty(t, got)
		require.Equal(t, want, got)
		require.Equal(t, wantUsage.CompletionTokens, gotUsage.CompletionTokens)
		require.Equal(t, wantUsage.PromptTokens, gotUsage.PromptTokens)
		ev := e.sink.byID(t, id)
		require.True(t, ev.Stream)
		require.Equal(t, gotUsage.CompletionTokens, ev.CompletionTokens)
		require.Positive(t, ev.TtftMs+1) // measured (may round to 0 ms on a fast machine)
	})

	t.Run("completions", func(t *testing.T) {
		var id string
		p := openai.CompletionNewParams{Model: "qwen-30b", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
			MaxTokens: openai.Int(10), Seed: openai.Int(7)}
		got, err := viaProxy.Completions.New(ctx, p, captureID(&id))
		require.NoError(t, err)
		p.Model = vllmsim.DefaultModel
		want, err := direct.Completions.New(ctx, p)
		require.NoError(t, err)
		require.Equal(t, want.Choices[0].Text, got.Choices[0].Text)
		require.Equal(t, want.Usage.CompletionTokens, e.sink.byID(t, id).CompletionTokens)
	})

	t.Run("embeddings", func(t *testing.T) {
		var id string
		got, err := viaProxy.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "qwen-30b",
			Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String("embed me")}}, captureID(&id))
		require.NoError(t, err)
		require.Len(t, got.Data, 1)
		require.NotEmpty(t, got.Data[0].Embedding)
		ev := e.sink.byID(t, id)
		require.Equal(t, got.Usage.PromptTokens, ev.PromptTokens)
		require.Equal(t, RouteEmbeddings, ev.Route)
	})

	t.Run("models", func(t *testing.T) {
		page, err := viaProxy.Models.List(ctx)
		require.NoError(t, err)
		var ids []string
		for _, m := range page.Data {
			ids = append(ids, m.ID)
		}
		// "hidden" exists but the key's allowed_models exclude it.
		require.Equal(t, []string{"qwen", "qwen-30b"}, ids)
	})

	t.Run("typed error through the client", func(t *testing.T) {
		_, err := viaProxy.Chat.Completions.New(ctx, chat("hidden"))
		var apiErr *openai.Error
		require.True(t, errors.As(err, &apiErr), "%v", err)
		require.Equal(t, http.StatusForbidden, apiErr.StatusCode)
		require.Equal(t, oai.CodeModelNotAllowed, apiErr.Code)
		require.Equal(t, oai.TypePermission, apiErr.Type)
	})
}

// TestIncludeUsage: the usage chunk is always requested upstream and
// relayed only to clients that asked for it; usage is recorded either way.
func TestIncludeUsage(t *testing.T) {
	t.Parallel()
	sim := startSim(t, nil)
	e := newEnv(t)
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("d1", "g", sim.URL()+"/v1", nil)
	e.apply()
	for _, tc := range []struct {
		name, extra string
		want        bool
	}{
		{"absent", `"stream":true`, false},
		{"false", `"stream":true,"stream_options":{"include_usage":false}`, false},
		{"null", `"stream":true,"stream_options":null`, false},
		{"true", `"stream":true,"stream_options":{"include_usage":true}`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := e.post(RouteChat, tok, chatBody("g", tc.extra))
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Equal(t, "text/event-stream", strings.Split(resp.Header.Get("Content-Type"), ";")[0])
			id := resp.Header.Get(oai.RequestIDHeader)
			data := sseData(t, resp.Body)
			resp.Body.Close()
			require.Equal(t, "[DONE]", data[len(data)-1])
			usageChunks := 0
			for _, d := range data[:len(data)-1] {
				var c struct {
					Choices []json.RawMessage `json:"choices"`
					Usage   *struct {
						CompletionTokens int64 `json:"completion_tokens"`
					} `json:"usage"`
				}
				require.NoError(t, json.Unmarshal([]byte(d), &c))
				if len(c.Choices) == 0 {
					usageChunks++
					require.NotNil(t, c.Usage)
				}
			}
			if tc.want {
				require.Equal(t, 1, usageChunks)
			} else {
				require.Zero(t, usageChunks)
			}
			ev := e.sink.byID(t, id)
			require.Positive(t, ev.CompletionTokens)
			require.Positive(t, ev.PromptTokens)
		})
	}
}

// TestClientDisconnect: a client leaving mid-stream cancels the upstream
// request (the engine counts an abort) and the request settles once, with
// the tokens seen.
func TestClientDisconnect(t *testing.T) {
	t.Parallel()
	sim := startSim(t, func(c *vllmsim.Config) { c.TimeScale = 1 }) // ~10 ms per token
	e := newEnv(t)
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("d1", "g", sim.URL()+"/v1", nil)
	e.apply()

	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.srv.URL+RouteChat,
		strings.NewReader(`{"model":"g","messages":[{"role":"user","content":"go on"}],"max_tokens":2000,"ignore_eos":true,"stream":true}`))
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	id := resp.Header.Get(oai.RequestIDHeader)
	buf := make([]byte, 4096)
	read := 0
	for read < 2000 { // a few chunks
		n, err := resp.Body.Read(buf)
		require.NoError(t, err)
		read += n
	}
	cancel()
	resp.Body.Close()
	waitFor(t, "the engine to abort the request", func() bool { return sim.Stats().FinishedAbort == 1 })
	waitFor(t, "the usage event", func() bool {
		for _, ev := range e.sink.events() {
			if ev.RequestId == id {
				return true
			}
		}
		return false
	})
	ev := e.sink.byID(t, id)
	require.Equal(t, int32(oai.StatusClientClosed), ev.Status)
	require.Equal(t, oai.CodeClientClosed, ev.ErrorCode)
	require.Positive(t, ev.CompletionTokens)
	require.Less(t, ev.CompletionTokens, int64(2000))
	require.Positive(t, ev.PromptTokens)
	require.Positive(t, ev.CostUsd)
}

// TestRetryAndOverload: a refusing deployment is skipped by retrying on
// another; max_concurrency is enforced per instance (503 overloaded with
// retry-after once every candidate is full).
func TestRetryAndOverload(t *testing.T) {
	t.Parallel()
	good := startSim(t, nil)
	bad := startSim(t, nil)
	require.NoError(t, bad.SetRefuseConnections(true))
	e := newEnv(t)
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("bad", "g", bad.URL()+"/v1", func(d *configv1.Deployment) { d.Weight = 1000 })
	e.deploy("good", "g", good.URL()+"/v1", nil)
	e.group("slow")
	e.deploy("slow", "slow", good.URL()+"/v1", func(d *configv1.Deployment) { d.MaxConcurrency = 1 })
	e.apply()

	retried := 0
	for range 6 {
		resp := e.post(RouteChat, tok, chatBody("g", ""))
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		ev := e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader))
		require.Equal(t, "good", ev.DeploymentId)
		if ev.Attempts == 2 {
			retried++
		}
	}
	require.Positive(t, retried, "the heavy refusing deployment was never tried first")

	// Hold the only slot of "slow" with a long stream.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.srv.URL+RouteChat,
		strings.NewReader(`{"model":"slow","messages":[{"role":"user","content":"x"}],"max_tokens":5000,"ignore_eos":true,"stream":true}`))
	req.Header.Set("Authorization", "Bearer "+tok)
	held, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer held.Body.Close()
	a := readErr(t, e.post(RouteChat, tok, chatBody("slow", "")))
	require.Equal(t, http.StatusServiceUnavailable, a.Status)
	require.Equal(t, oai.CodeOverloaded, a.Error.Code)
	require.Equal(t, "1", a.Header.Get("Retry-After"))
	require.Equal(t, "1000", a.Header.Get("Retry-After-Ms"))
}

// TestDeadline: the total deadline ends a request that outlives it.
func TestDeadline(t *testing.T) {
	t.Parallel()
	sim := startSim(t, func(c *vllmsim.Config) { c.Faults.Delay = 2 * time.Second })
	e := newEnv(t, func(c *Config) { c.RequestTimeout = 200 * time.Millisecond })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("d1", "g", sim.URL()+"/v1", nil)
	e.apply()
	a := readErr(t, e.post(RouteChat, tok, chatBody("g", "")))
	require.Equal(t, http.StatusGatewayTimeout, a.Status)
	require.Equal(t, oai.CodeUpstreamTimeout, a.Error.Code)
	require.Equal(t, oai.TypeTimeout, a.Error.Type)
}

// TestClientLeavesAtDone: a client that closes its connection as soon as
// it has read [DONE] (the OpenAI SDKs stop reading there), while the
// upstream has not ended its response yet, got the whole answer: the
// request is recorded as the 200 it was, with its usage, not as a client
// that left (CI saw TestProxyEndToEnd's stream counted 499 this way).
func TestClientLeavesAtDone(t *testing.T) {
	t.Parallel()
	upstreamGone := make(chan struct{})
	eng := newFakeEngine(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		fmt.Fprint(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n")
		fmt.Fprint(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1,\"total_tokens\":8}}\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
		w.(http.Flusher).Flush()
		// The response does not end until the proxy gives up on it.
		<-r.Context().Done()
		close(upstreamGone)
	})
	e := newEnv(t)
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("d1", "g", eng.base(), nil)
	e.apply()

	resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	id := resp.Header.Get(oai.RequestIDHeader)
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() && sc.Text() != "data: [DONE]" {
	}
	require.Equal(t, "data: [DONE]", sc.Text())
	require.NoError(t, resp.Body.Close()) // before the end of the body: the connection closes
	waitFor(t, "the upstream request to end", func() bool {
		select {
		case <-upstreamGone:
			return true
		default:
			return false
		}
	})
	waitFor(t, "the usage event", func() bool {
		return slices.ContainsFunc(e.sink.events(), func(ev *usagev1.UsageEvent) bool { return ev.RequestId == id })
	})
	ev := e.sink.byID(t, id)
	require.Equal(t, int32(http.StatusOK), ev.Status)
	require.Empty(t, ev.ErrorCode)
	require.Equal(t, int64(1), ev.CompletionTokens)
	require.Equal(t, int64(7), ev.PromptTokens)
}
