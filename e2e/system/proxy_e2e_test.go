package system

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane"

	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// startSim starts a fast vLLM simulator for the proxy tests.
func startSim(t testing.TB) *vllmsim.Server {
	t.Helper()
	cfg := vllmsim.DefaultConfig()
	cfg.Addr, cfg.TimeScale, cfg.MeanOutputTokens = "127.0.0.1:0", 20, 16
	s := harness.StartSim(t, cfg)
	return s
}

// closedPort returns an address nothing listens on.
func closedPort(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// openAIError is an OpenAI-shaped error answer.
type openAIError struct {
	status int
	id     string
	hdr    http.Header
	Error  struct {
		Type, Code, Message string
		Param               *string
	}
}

func postJSON(t testing.TB, url, tok, body string) openAIError {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	out := openAIError{status: resp.StatusCode, id: resp.Header.Get(dataplane.RequestIDHeader), hdr: resp.Header}
	require.NoError(t, json.Unmarshal(b, &out), "%s", b)
	return out
}

// TestProxyEndToEnd drives the real data plane (config from the control
// plane over NATS, deployments created through the ModelService) with the
// official OpenAI client, then walks the error matrix.
func TestProxyEndToEnd(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	sim := startSim(t)
	ctx := context.Background()
	m := d.modelClient()
	for _, g := range []string{"qwen-30b", "other", "down"} {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g, PlatformWide: true}))
		require.NoError(t, err)
	}
	dep := func(group, apiBase string) {
		_, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: group, ApiBase: apiBase, UpstreamModel: vllmsim.DefaultModel, Weight: 1,
			Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6}}))
		require.NoError(t, err)
	}
	dep("qwen-30b", sim.URL()+"/v1")
	dep("other", sim.URL()+"/v1")
	dep("down", "http://"+closedPort(t)+"/v1")

	c := d.Clients()
	ten := d.NewTenant("acme")
	aliasKey, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID,
		ModelGroupAliases: map[string]string{"qwen": "qwen-30b"},
		Limits:            &adminv1.Limits{AllowedModels: []string{"qwen-30b", "down"}}}))
	require.NoError(t, err)
	tok := aliasKey.Msg.Token
	soon, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID,
		ExpireTime: timestamppb.New(time.Now().Add(1500 * time.Millisecond))}))
	require.NoError(t, err)

	p := d.StartProxy("default", time.Minute)
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("down")) == 1 }, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, tok, http.StatusOK, 10*time.Second)

	client := openai.NewClient(option.WithBaseURL(p.URL+"/v1"), option.WithAPIKey(tok), option.WithMaxRetries(0))
	direct := openai.NewClient(option.WithBaseURL(sim.URL()+"/v1"), option.WithAPIKey("x"), option.WithMaxRetries(0))
	params := openai.ChatCompletionNewParams{Model: "qwen", Seed: openai.Int(3), MaxTokens: openai.Int(20),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Hello through the data plane.")}}

	got, err := client.Chat.Completions.New(ctx, params)
	require.NoError(t, err)
	require.NotEmpty(t, got.Choices[0].Message.Content)
	require.Positive(t, got.Usage.CompletionTokens)

	stream := client.Chat.Completions.NewStreaming(ctx, params)
	var streamed strings.Builder
	for stream.Next() {
		if ch := stream.Current(); len(ch.Choices) > 0 {
			streamed.WriteString(ch.Choices[0].Delta.Content)
		}
	}
	require.NoError(t, stream.Err())
	params.Model = vllmsim.DefaultModel
	want, err := direct.Chat.Completions.New(ctx, params)
	require.NoError(t, err)
	require.Equal(t, want.Choices[0].Message.Content, streamed.String(), "streamed text differs from the upstream's")
	require.Equal(t, got.Choices[0].Message.Content, streamed.String())

	cmp, err := client.Completions.New(ctx, openai.CompletionNewParams{Model: "qwen-30b", MaxTokens: openai.Int(8),
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("The gateway")}})
	require.NoError(t, err)
	require.NotEmpty(t, cmp.Choices)
	emb, err := client.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "qwen",
		Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String("vector")}})
	require.NoError(t, err)
	require.NotEmpty(t, emb.Data[0].Embedding)
	models, err := client.Models.List(ctx)
	require.NoError(t, err)
	var ids []string
	for _, mo := range models.Data {
		ids = append(ids, mo.ID)
	}
	require.Equal(t, []string{"down", "qwen", "qwen-30b"}, ids, "only what the key may use")

	// Error matrix through the real data plane.
	blockedAt := func(scope string) string {
		tt := d.NewTenant("blk-" + scope)
		var err error
		switch scope {
		case "key":
			_, err = c.Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: tt.KeyID}))
		case "user":
			_, err = c.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: tt.UserID}))
		case "team":
			_, err = c.Team.BlockTeam(ctx, connect.NewRequest(&adminv1.BlockTeamRequest{Id: tt.TeamID}))
		case "org":
			_, err = c.Org.BlockOrg(ctx, connect.NewRequest(&adminv1.BlockOrgRequest{Id: tt.OrgID}))
		}
		require.NoError(t, err)
		harness.WaitStatus(t, p, tt.Token, http.StatusForbidden, 10*time.Second)
		return tt.Token
	}
	body := `{"model":"qwen","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
	chatURL := p.URL + "/v1/chat/completions"
	time.Sleep(time.Until(soon.Msg.Key.ExpireTime.AsTime()))
	for _, tc := range []struct {
		name, tok, body  string
		status           int
		typ, code, param string
	}{
		{"unknown key", "sk-sluice-nope", body, 401, "invalid_request_error", "invalid_api_key", ""},
		{"expired key", soon.Msg.Token, body, 401, "invalid_request_error", "key_expired", ""},
		{"key blocked", blockedAt("key"), body, 403, "permission_error", "key_blocked", ""},
		{"user blocked", blockedAt("user"), body, 403, "permission_error", "user_blocked", ""},
		{"team blocked", blockedAt("team"), body, 403, "permission_error", "team_blocked", ""},
		{"org blocked", blockedAt("org"), body, 403, "permission_error", "org_blocked", ""},
		{"model not allowed", tok, strings.Replace(body, "qwen", "other", 1), 403, "permission_error", "model_not_allowed", "model"},
		{"unknown model", tok, strings.Replace(body, "qwen", "nope", 1), 404, "not_found_error", "model_not_found", "model"},
		{"malformed JSON", tok, `{"model":`, 400, "invalid_request_error", "invalid_json", ""},
		{"body too large", tok, `{"model":"qwen","pad":"` + strings.Repeat("x", 5<<20) + `"}`, 413, "invalid_request_error", "request_too_large", ""},
		{"upstream refused", tok, strings.Replace(body, "qwen", "down", 1), 502, "upstream_error", "upstream_error", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := postJSON(t, chatURL, tc.tok, tc.body)
			require.Equal(t, tc.status, a.status, "%+v", a.Error)
			require.Equal(t, tc.typ, a.Error.Type)
			require.Equal(t, tc.code, a.Error.Code)
			require.Equal(t, tc.param, deref(a.Error.Param))
			require.True(t, strings.HasPrefix(a.id, "req_"), "request id %q", a.id)
		})
	}

	// A request is counted when it has settled, which can trail the
	// client's last read: wait for both chat completions to be counted.
	// (The metrics are printed when the count is not reached: a message
	// argument would be evaluated before the first poll.)
	var metrics string
	if !harness.Until(func() bool {
		_, metrics = get(t, p.URL+"/metrics")
		return strings.Contains(metrics, `sluice_proxy_requests_total{model_group="qwen-30b",route="/v1/chat/completions",status_class="2xx"} 2`+"\n")
	}, 10*time.Second, 10*time.Millisecond) {
		var counted []string
		for line := range strings.Lines(metrics) {
			if strings.HasPrefix(line, "sluice_proxy_requests_total{") {
				counted = append(counted, strings.TrimSpace(line))
			}
		}
		t.Fatalf("the two chat completions (one streamed) were not counted 2xx within 10s; requests counted: %q", counted)
	}
	require.Contains(t, metrics, `sluice_proxy_upstream_errors_total{deployment=`)
	require.Contains(t, metrics, `sluice_dataplane_auth_total{result="ok"}`)
	require.Contains(t, metrics, "sluice_proxy_ttft_seconds_bucket")
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}
