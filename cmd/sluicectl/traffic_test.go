package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

func TestReadTrafficFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	yml := write("org.yaml", `default_class: TRAFFIC_CLASS_INTERACTIVE
rules:
- {header: User-Agent, pattern: ^claude-code/, traffic_class: TRAFFIC_CLASS_AGENT}
demotion: {max_prompt_tokens: 8000, maxInteractiveInFlightPerKey: 1}
`)
	got := &adminv1.OrgTraffic{}
	if err := readTrafficFile(yml, got); err != nil {
		t.Fatal(err)
	}
	want := &adminv1.OrgTraffic{
		DefaultClass: adminv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE,
		Rules: []*adminv1.ClassificationRule{{Header: "User-Agent", Pattern: "^claude-code/",
			TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_AGENT}},
		Demotion: &adminv1.Demotion{MaxPromptTokens: 8000, MaxInteractiveInFlightPerKey: 1},
	}
	if !proto.Equal(want, got) {
		t.Errorf("got %v, want %v", got, want)
	}
	dep := &adminv1.DeploymentTraffic{}
	if err := readTrafficFile(write("dep.json", `{"interactive_reserve": 2, "class_priority": {"interactive": 0}}`), dep); err != nil {
		t.Fatal(err)
	}
	if dep.GetInteractiveReserve() != 2 || dep.GetClassPriority().Interactive == nil {
		t.Errorf("deployment: %v", dep)
	}
	for name, body := range map[string]string{"typo.yaml": "interactive_reserv: 2\n", "bad.yaml": "rules: [\n"} {
		if err := readTrafficFile(write(name, body), &adminv1.DeploymentTraffic{}); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if err := readTrafficFile("", &adminv1.OrgTraffic{}); err == nil {
		t.Error("no --file: no error")
	}
}

func TestTrafficCommands(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	org := root.okJSON("org", "create", "traffic-cli")["id"].(string)
	dir := t.TempDir()
	rules := filepath.Join(dir, "rules.yaml")
	require.NoError(t, os.WriteFile(rules, []byte("rules:\n- {header: User-Agent, pattern: ^claude-code/, traffic_class: TRAFFIC_CLASS_AGENT}\n"), 0o600))
	set := root.okJSON("traffic", "org", "set", org, "-f", rules)
	require.Equal(t, "^claude-code/", set["rules"].([]any)[0].(map[string]any)["pattern"])
	require.Contains(t, root.ok("traffic", "org", "get", org), "claude-code")

	bad := filepath.Join(dir, "bad.yaml")
	require.NoError(t, os.WriteFile(bad, []byte("rules:\n- {header: User-Agent, pattern: '(unclosed', traffic_class: TRAFFIC_CLASS_AGENT}\n"), 0o600))
	out := root.fail("traffic", "org", "set", org, "--file", bad)
	require.Contains(t, out, "invalid_argument")
	require.Contains(t, out, "traffic.rules[0].pattern")

	root.okJSON("model-group", "create", "traffic-g")
	require.Contains(t, root.ok("traffic", "model-group", "get", "traffic-g"), "{}")
}
