package main

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/e2e/vllmsim"
)

// startSim starts a fast vLLM simulator serving model (apiKey: required
// bearer token, "" for none).
func startSim(t *testing.T, model, apiKey string) *vllmsim.Server {
	t.Helper()
	cfg := vllmsim.DefaultConfig()
	cfg.Addr, cfg.TimeScale, cfg.MeanOutputTokens, cfg.Model, cfg.APIKey = "127.0.0.1:0", 20, 8, model, apiKey
	s, err := vllmsim.Start(cfg, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// litellmConfig is testdata/litellm-config.yaml with the pools' base URLs.
func litellmConfig(t *testing.T, chat, agents string) string {
	t.Helper()
	b, err := os.ReadFile("testdata/litellm-config.yaml")
	require.NoError(t, err)
	s := strings.NewReplacer("${CHAT_API_BASE}", chat, "${AGENT_API_BASE}", agents).Replace(string(b))
	p := filepath.Join(t.TempDir(), "config.yaml")
	require.NoError(t, os.WriteFile(p, []byte(s), 0o600))
	return p
}

// The report names every trap of the reference config, with Sluice's
// equivalent (or that there is none).
func TestImportLiteLLMReport(t *testing.T) {
	t.Parallel()
	cfg, err := os.ReadFile(litellmConfig(t, "http://chat:8000/v1", "http://agents:8000/v1"))
	require.NoError(t, err)
	teams, err := os.ReadFile("testdata/litellm-teams.json")
	require.NoError(t, err)
	res, err := importLiteLLM(cfg, teams, "platform")
	require.NoError(t, err)
	var report bytes.Buffer
	require.NoError(t, res.writeReport(&report))
	got := map[string]string{}
	for _, tr := range res.traps {
		got[tr.setting+" "+tr.where] = tr.sluice
	}
	for _, want := range []string{
		"litellm_params.input_cost_per_token/output_cost_per_token model_list[2] (embed-small)",
		"model_info.max_input_tokens model_list[1] (qwen-30b-agentes)",
		"model_info.max_input_tokens model_list[2] (embed-small)",
		"team.max_parallel_requests team plataforma-agentes",
		"litellm_params.priority model_list[0] (qwen-30b-interactivo)",
		"litellm_settings.drop_params ",
		"litellm_params.tag_regex model_list[1] (qwen-30b-agentes)",
		"router_settings.model_group_alias ",
		"router_settings.routing_strategy ",
		"router_settings.num_retries ",
		"router_settings.retry_after ",
		"router_settings.cooldown_time ",
		"router_settings.allowed_fails_policy ",
		"router_settings.retry_policy ",
		"litellm_settings.request_timeout ",
		"general_settings.fail_closed_budget_enforcement ",
		"general_settings.apply_user_budget_to_team_keys ",
		"general_settings.store_audit_logs ",
		"general_settings.user_api_key_cache_ttl ",
		"general_settings.max_in_flight_requests_per_worker ",
		"general_settings.global_max_parallel_requests ",
		"litellm_params.api_key model_list[2] (embed-small)",
		"team.router_settings.num_retries team plataforma-agentes",
		"general_settings.proxy_batch_write_at ", // not mapped: named, not dropped
		"team.models team plataforma-agentes",
	} {
		require.Contains(t, got, want, "report:\n%s", report.String())
	}
	require.Contains(t, got["litellm_params.tag_regex model_list[1] (qwen-30b-agentes)"], "no equivalent yet")
	require.Contains(t, got["litellm_params.input_cost_per_token/output_cost_per_token model_list[2] (embed-small)"], "apply refuses")
	require.NotContains(t, report.String(), "sk-inline-embed-secret")
	keys := []byte(`[{"token": "88dc28d0f030c55ed4ab77ed8faf098196cb1c05df778539800c9f1243fe6b4b", "key_alias": "claude-code-ci",
		"team_id": "8d1c6c2e", "max_parallel_requests": 8, "rpm_limit": 600, "models": ["qwen-30b"], "priority": 1,
		"router_settings": {"model_group_alias": {"qwen-30b": "qwen-30b-agentes"}}}]`)
	require.NoError(t, res.importKeys(keys, teams, "platform"))
	got = map[string]string{}
	for _, tr := range res.traps {
		got[tr.setting+" "+tr.where] = tr.sluice
	}
	require.Equal(t, "sluicectl key create --org platform --team <id of team plataforma-agentes> --alias claude-code-ci --rpm-limit 600 --max-parallel-requests 8 --allowed-models qwen-30b-agentes --model-group-alias qwen-30b=qwen-30b-agentes",
		got["key key claude-code-ci"])
	require.Contains(t, got, "key.priority key claude-code-ci")
	var docs bytes.Buffer
	require.NoError(t, encodeDocuments(&docs, res.docs))
	require.NotContains(t, docs.String(), "sk-inline-embed-secret")
	require.Contains(t, docs.String(), "env: AGENT_POOL_KEY")
}

// import litellm → apply → a proxy serves both pools with the mapped
// settings: each team's key reaches its pool through the alias, the
// agent pool with its credential.
func TestImportLiteLLMThenApplyServesBothPools(t *testing.T) {
	t.Parallel()
	const agentKey = "sk-agent-pool-upstream"
	chat, agents := startSim(t, "Qwen3-30B", ""), startSim(t, "Qwen3-30B", agentKey)
	server, _, natsURL := startServerNATS(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken, "AGENT_POOL_KEY="+agentKey)
	dir := t.TempDir()

	// The embedding model is unpriced: drop it from the config for the
	// apply (the report test covers it), as an operator would after
	// reading the report.
	cfgPath := litellmConfig(t, chat.URL()+"/v1", agents.URL()+"/v1")
	b, err := os.ReadFile(cfgPath)
	require.NoError(t, err)
	cfg := string(b)
	i, j := strings.Index(cfg, "  - model_name: embed-small"), strings.Index(cfg, "router_settings:")
	cfg = cfg[:i] + "\n" + cfg[j:]
	require.NoError(t, os.WriteFile(cfgPath, []byte(cfg), 0o600))

	reportPath := filepath.Join(dir, "report.txt")
	docs := root.ok("import", "litellm", cfgPath, "--teams", "testdata/litellm-teams.json", "--org", "platform", "--report", reportPath)
	report, err := os.ReadFile(reportPath)
	require.NoError(t, err)
	require.Contains(t, string(report), "router_settings.num_retries")
	docsPath := filepath.Join(dir, "sluice.yaml")
	require.NoError(t, os.WriteFile(docsPath, []byte(docs), 0o600))
	out := root.ok("apply", "-f", docsPath)
	require.Contains(t, out, "Applied: 7 to create, 0 to change, 0 to delete.", out)
	require.Equal(t, "Applied: no changes.\n", root.ok("apply", "-f", docsPath))

	// The mapped settings, as the control plane holds them.
	agentTeam := root.ok("get", "team", "plataforma-agentes", "--org", "platform")
	for _, want := range []string{"max_parallel_requests: 20", "rpm_limit: 600", "max_budget: 200", "qwen-30b: qwen-30b-agentes", "- qwen-30b-agentes"} {
		require.Contains(t, agentTeam, want)
	}
	require.Contains(t, root.ok("get", "team", "chat", "--org", "platform"), "qwen-30b: qwen-30b-interactivo")
	require.Contains(t, root.ok("get", "org", "platform"), "max_budget: 500")
	groups := root.ok("get", "model-group")
	require.Contains(t, groups, "max_input_tokens: 32768")
	require.Contains(t, groups, "max_concurrency: 32")
	require.Contains(t, groups, "stored: true")

	var teams []map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("team", "list", "-o", "json")), &teams))
	keyOf := map[string]string{}
	for _, tm := range teams {
		keyOf[tm["name"].(string)] = root.okJSON("key", "create", "--org", tm["org_id"].(string), "--team", tm["id"].(string))["token"].(string)
	}
	require.Len(t, keyOf, 2)

	addr := startProxy(t, natsURL, "default", "dp-import", "--redis-key-prefix", "sluicectl-import-"+strings.ReplaceAll(t.Name(), "/", "-")+":")
	chatCompletion := func(token string) (int, string) {
		req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/chat/completions",
			strings.NewReader(`{"model":"qwen-30b","messages":[{"role":"user","content":"hello"}],"max_tokens":8}`))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	served := func(s *vllmsim.Server) uint64 { st := s.Stats(); return st.FinishedStop + st.FinishedLength }
	for _, tc := range []struct {
		team string
		pool *vllmsim.Server
	}{{"chat", chat}, {"plataforma-agentes", agents}} {
		before := served(tc.pool)
		// The proxy learns the keys from events; poll until it does.
		deadline := time.Now().Add(20 * time.Second)
		for {
			code, body := chatCompletion(keyOf[tc.team])
			if code == http.StatusOK {
				break
			}
			require.True(t, time.Now().Before(deadline), "team %s: %d %s", tc.team, code, body)
			time.Sleep(100 * time.Millisecond)
		}
		require.Eventually(t, func() bool { return served(tc.pool) > before }, 10*time.Second, 20*time.Millisecond, "team %s reaches its pool", tc.team)
	}
}
