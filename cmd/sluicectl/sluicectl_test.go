package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// The end-to-end tests drive the built sluicectl binary against a real
// control plane: the built `sluice control` binary on a fresh Postgres
// database (cmd/ cannot import controlplane/internal, so the server runs
// as its own process, exactly as users run it).

var bins struct {
	dir       string
	sluicectl string
	sluice    string
	err       error
}

func TestMain(m *testing.M) {
	code := func() int {
		dir, err := os.MkdirTemp("", "sluicectl-test-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		bins.dir = dir
		bins.sluicectl = filepath.Join(dir, "sluicectl")
		bins.sluice = filepath.Join(dir, "sluice")
		for out, pkg := range map[string]string{
			bins.sluicectl: "github.com/sluicegw/sluice/cmd/sluicectl",
			bins.sluice:    "github.com/sluicegw/sluice/cmd/sluice",
		} {
			cmd := exec.Command("go", "build", "-o", out, pkg)
			if b, err := cmd.CombinedOutput(); err != nil {
				bins.err = errors.Join(bins.err, fmt.Errorf("go build %s: %w\n%s", pkg, err, b))
			}
		}
		return m.Run()
	}()
	os.Exit(code)
}

// bootstrapToken is the platform-admin token of test servers.
const bootstrapToken = "sluicectl-test-bootstrap-token-0123456789"

// testKEK is the key ring of test servers (base64 of 32 bytes).
const testKEK = "1:c2x1aWNlY3RsLXRlc3Qta2VrLTAxMjM0NTY3ODlhYmM="

// syncBuffer collects a process's output safely.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startServer runs `sluice control` on a fresh database and returns its
// admin API URL once it accepts connections, and the database URL.
func startServer(t *testing.T) (string, string) {
	t.Helper()
	server, dbURL, _ := startServerNATS(t)
	return server, dbURL
}

// startServerNATS is startServer that also returns the URL of the
// control plane's NATS server (an embedded JetStream server of the test's
// own, so parallel tests never share streams).
func startServerNATS(t *testing.T) (string, string, string) {
	t.Helper()
	require.NoError(t, bins.err)
	dbURL := testsvc.NewDatabase(t)
	nats := testsvc.StartNATS(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())

	var logs syncBuffer
	cmd := exec.Command(bins.sluice, "control", "--addr", addr, "--database-url", dbURL, "--nats-url", nats.URL, "--migrate")
	cmd.Env = []string{
		"PATH=" + os.Getenv("PATH"),
		"HOME=" + t.TempDir(),
		"SLUICE_ADMIN_TOKEN=" + bootstrapToken,
		"SLUICE_KEY_PEPPER=1:sluicectl-test-pepper-0123456789abcdef",
		"SLUICE_KEK=" + testKEK,
	}
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case err := <-exited:
			t.Logf("exit: %v", err)
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			t.Logf("killed after 10 s: %v", <-exited)
		}
		if t.Failed() {
			t.Logf("sluice control output:\n%s", logs.String())
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case err := <-exited:
			t.Fatalf("sluice control exited early (%v):\n%s", err, logs.String())
		default:
		}
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return "http://" + addr, dbURL, nats.URL
		}
		if time.Now().After(deadline) {
			t.Fatalf("sluice control did not listen on %s within 30s:\n%s", addr, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// cliEnv is the environment of sluicectl runs: a private HOME and config
// file, nothing inherited from the developer's environment.
type cliEnv struct {
	t      *testing.T
	home   string
	config string
	extra  []string
}

func newCLIEnv(t *testing.T) *cliEnv {
	home := t.TempDir()
	return &cliEnv{t: t, home: home, config: filepath.Join(home, "cfg", "sluice", "config.yaml")}
}

// with returns a copy of e with extra environment variables.
func (e *cliEnv) with(kv ...string) *cliEnv {
	c := *e
	c.extra = append(append([]string{}, e.extra...), kv...)
	return &c
}

type result struct {
	stdout, stderr string
	code           int
}

// run runs sluicectl with args.
func (e *cliEnv) run(args ...string) result {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bins.sluicectl, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + e.home, "SLUICE_CONFIG=" + e.config}, e.extra...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		e.t.Fatalf("run sluicectl %v: %v", args, err)
	}
	return result{stdout.String(), stderr.String(), code}
}

// ok runs sluicectl and requires success.
func (e *cliEnv) ok(args ...string) string {
	e.t.Helper()
	r := e.run(args...)
	require.Equal(e.t, 0, r.code, "sluicectl %s\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.stdout, r.stderr)
	return r.stdout
}

// fail runs sluicectl and requires a non-zero exit; it returns stderr.
func (e *cliEnv) fail(args ...string) string {
	e.t.Helper()
	r := e.run(args...)
	require.NotEqual(e.t, 0, r.code, "sluicectl %s should fail\nstdout: %s", strings.Join(args, " "), r.stdout)
	require.Empty(e.t, r.stdout, "a failing command prints nothing on stdout")
	return r.stderr
}

// okJSON runs sluicectl with -o json and decodes the output.
func (e *cliEnv) okJSON(args ...string) map[string]any {
	e.t.Helper()
	out := e.ok(append(args, "-o", "json")...)
	var m map[string]any
	require.NoError(e.t, json.Unmarshal([]byte(out), &m), "output of %v is not a JSON object:\n%s", args, out)
	return m
}

func obj(t *testing.T, m map[string]any, key string) map[string]any {
	t.Helper()
	v, ok := m[key].(map[string]any)
	require.True(t, ok, "%q is not an object in %v", key, m)
	return v
}

func TestEndToEnd(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	env := newCLIEnv(t)
	root := env.with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)

	// Platform admin (bootstrap token from the environment, no config).
	acme := root.okJSON("org", "create", "acme", "--rpm-limit", "1000", "--max-budget", "500", "--budget-duration", "30d", "--metadata", "tier=gold")
	orgID := acme["id"].(string)
	require.Equal(t, "acme", acme["name"])
	require.Equal(t, map[string]any{"rpm_limit": "1000", "max_budget": 500.0, "budget_duration": "30d"}, acme["limits"])
	other := root.okJSON("org", "create", "--name", "other")
	otherID := other["id"].(string)

	// An org-scoped admin token, created with the CLI itself.
	r := root.run("-o", "json", "token", "create", "--scope", "org", "--org", orgID, "--role", "admin", "--name", "acme-admin")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stderr, "cannot be shown again")
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &created))
	orgToken, _ := created["token"].(string)
	require.True(t, strings.HasPrefix(orgToken, "sat-"), "token %q", orgToken)
	require.Equal(t, "SCOPE_ORG", obj(t, created, "admin_token")["scope"])

	// login stores the context in a private file.
	loginOut := env.run("login", "--server", server+"/", "--token", orgToken, "--context", "acme")
	require.Equal(t, 0, loginOut.code, loginOut.stderr)
	require.Contains(t, loginOut.stdout, `context "acme" saved`)
	st, err := os.Stat(env.config)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), "config file mode")
	dst, err := os.Stat(filepath.Dir(env.config))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), dst.Mode().Perm(), "config directory mode")
	raw, err := os.ReadFile(env.config)
	require.NoError(t, err)
	var cfg config
	require.NoError(t, yaml.UnmarshalStrict(raw, &cfg))
	require.Equal(t, config{CurrentContext: "acme", Contexts: []configContext{{Name: "acme", Server: server, Token: orgToken}}}, cfg)

	who := env.okJSON("whoami")
	require.Equal(t, "SCOPE_ORG", who["scope"])
	require.Equal(t, orgID, who["org_id"])
	require.Equal(t, "ROLE_ADMIN", who["role"])
	// SLUICE_TOKEN overrides the context's token.
	require.Equal(t, "bootstrap", env.with("SLUICE_TOKEN=" + bootstrapToken).okJSON("whoami")["principal"])

	// context list marks the current context and never shows tokens.
	ctxList := env.ok("context", "list")
	require.Regexp(t, `(?m)^\*\s+acme\s+`+server+`$`, ctxList)
	require.NotContains(t, ctxList, orgToken, "context list never prints tokens")

	// The org token manages its own org.
	team := env.okJSON("team", "create", "eng", "--rpm-limit", "50", "--traffic-class", "agent", "--model-group-alias", "gpt=fast")
	teamID := team["id"].(string)
	require.Equal(t, orgID, team["org_id"])
	require.Equal(t, "TRAFFIC_CLASS_AGENT", team["traffic_class"])
	require.Equal(t, map[string]any{"gpt": "fast"}, team["model_group_aliases"])
	teamTable := env.ok("team", "list")
	require.Regexp(t, `(?m)^ID\s+ORG\s+NAME\s+BLOCKED`, teamTable)
	require.Contains(t, teamTable, teamID)

	r = env.run("key", "create", "--team", teamID, "--alias", "ci", "--expires", "30d", "--tags", "a,b", "--tags", "c",
		"--rpm-limit", "5", "--model-rpm-limit", "gpt=3", "--model-max-budget", "gpt=1.5", "--budget-duration", "1d",
		"--traffic-class", "batch", "--metadata", "owner=ci", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stderr, "cannot be shown again")
	var keyResp map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &keyResp))
	firstToken := keyResp["token"].(string)
	require.NotEmpty(t, firstToken)
	key := obj(t, keyResp, "key")
	keyID := key["id"].(string)
	require.Equal(t, teamID, key["team_id"])
	require.Equal(t, []any{"a", "b", "c"}, key["tags"])
	require.Equal(t, "TRAFFIC_CLASS_BATCH", key["traffic_class"])
	exp, err := time.Parse(time.RFC3339Nano, key["expire_time"].(string))
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(30*24*time.Hour), exp, 5*time.Minute)

	// update sends exactly the given fields: the other limits survive.
	upd := env.okJSON("key", "update", keyID, "--rpm-limit", "10")
	require.Equal(t, map[string]any{
		"rpm_limit": "10", "budget_duration": "1d",
		"model_rpm_limit": map[string]any{"gpt": "3"}, "model_max_budget": map[string]any{"gpt": 1.5},
	}, upd["limits"])
	require.Equal(t, "ci", upd["alias"])
	// --clear unsets a field.
	upd = env.okJSON("key", "update", keyID, "--clear", "rpm-limit", "--alias", "ci-2")
	require.NotContains(t, obj(t, upd, "limits"), "rpm_limit")
	require.Equal(t, "ci-2", upd["alias"])

	// Rotation with a grace period.
	r = env.run("key", "rotate", keyID, "--grace", "24h", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stderr, "cannot be shown again")
	var rot map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rot))
	require.NotEqual(t, firstToken, rot["token"])
	require.Equal(t, "1", obj(t, rot, "key")["rotation_count"])
	until, err := time.Parse(time.RFC3339Nano, rot["old_token_valid_until"].(string))
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(24*time.Hour), until, 5*time.Minute)

	// Block, shown as a table; then read back as YAML.
	require.Regexp(t, `(?m)^blocked:\s+true$`, env.ok("key", "block", keyID))
	var keyYAML map[string]any
	require.NoError(t, yaml.Unmarshal([]byte(env.ok("-o", "yaml", "key", "get", keyID)), &keyYAML))
	require.Equal(t, true, keyYAML["blocked"])
	require.Equal(t, keyID, keyYAML["id"])
	require.Contains(t, env.ok("key", "list", "--blocked"), keyID)

	// The audit trail has every change, and its chain verifies.
	var events []map[string]any
	require.NoError(t, json.Unmarshal([]byte(env.ok("audit", "list", "--object-type", "key", "--object-id", keyID, "-o", "json")), &events))
	var actions []string
	for _, e := range events {
		actions = append(actions, e["action"].(string))
	}
	require.Equal(t, []string{"created", "updated", "updated", "rotated", "blocked"}, actions)
	verify := env.ok("audit", "verify")
	require.Regexp(t, `^OK: \d+ audit records checked`, verify)

	// An org token cannot see another org: the server's NotFound message.
	stderr := env.fail("org", "get", otherID)
	require.Contains(t, stderr, "sluicectl: not_found: ")
	require.Contains(t, stderr, otherID)
	// ... nor create objects in it.
	require.Regexp(t, `sluicectl: (permission_denied|not_found): `, env.fail("team", "create", "x", "--org", otherID))

	// Bad flag values fail before any call, naming the flag.
	stderr = env.fail("key", "update", keyID, "--rpm-limit", "abc")
	require.Contains(t, stderr, `invalid value "abc" for flag -rpm-limit: want a whole number`)
	require.Contains(t, env.fail("key", "create", "--traffic-class", "fast"), "want one of interactive, agent, batch")
	require.Contains(t, env.fail("key", "update", keyID), "nothing to update")
	require.Contains(t, env.fail("org", "list", "-o", "xml"), `-o "xml": want table, json or yaml`)
	// Server-side validation errors name the field.
	require.Contains(t, env.fail("team", "create", "bad", "--max-budget", "5"), "invalid_argument: ")
}

func TestUsersMembersCustomersAndPaging(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	orgID := root.okJSON("org", "create", "paging")["id"].(string)
	team := root.okJSON("team", "create", "--org", orgID, "--name", "t1")
	var userIDs []string
	for i := range 3 {
		u := root.okJSON("user", "create", fmt.Sprintf("u%d@example.com", i), "--org", orgID, "--display-name", fmt.Sprintf("User %d", i), "--rpm-limit", "7")
		userIDs = append(userIDs, u["id"].(string))
	}
	var users []map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("user", "list", "--org", orgID, "-o", "json")), &users))
	require.Len(t, users, 3)
	require.NoError(t, json.Unmarshal([]byte(root.ok("user", "list", "--org", orgID, "--limit", "2", "-o", "json")), &users))
	require.Len(t, users, 2)

	m := root.okJSON("member", "add", team["id"].(string), userIDs[0], "--max-budget-in-team", "20", "--budget-duration", "30d", "--rpm-limit", "3")
	require.Equal(t, 20.0, m["max_budget_in_team"])
	m = root.okJSON("member", "update", team["id"].(string), userIDs[0], "--tpm-limit", "900")
	require.Equal(t, map[string]any{"budget_duration": "30d", "rpm_limit": "3", "tpm_limit": "900"}, m["limits"])
	require.Contains(t, root.ok("team", "member", "list", team["id"].(string)), userIDs[0])
	require.Equal(t, userIDs[0], root.okJSON("member", "get", team["id"].(string), userIDs[0])["user_id"])
	require.Contains(t, root.fail("member", "get", team["id"].(string), userIDs[1]), "not_found")
	require.Contains(t, root.ok("member", "remove", team["id"].(string), userIDs[0]), "Removed user")

	c := root.okJSON("customer", "create", "cust-1", "--org", orgID, "--display-name", "Customer One", "--max-budget", "10", "--budget-duration", "1mo")
	require.Equal(t, "cust-1", c["external_id"])
	require.Equal(t, true, root.okJSON("customer", "block", c["id"].(string))["blocked"])
	blocked, _ := root.okJSON("customer", "unblock", c["id"].(string))["blocked"].(bool)
	require.False(t, blocked)
	require.Contains(t, root.ok("user", "delete", userIDs[2]), "Deleted user")
	require.Contains(t, root.fail("user", "get", userIDs[2]), "not_found")

	// Per-model limits are not offered where the API rejects them.
	require.Contains(t, root.fail("user", "create", "x@example.com", "--org", orgID, "--model-rpm-limit", "a=1"), "flag provided but not defined: -model-rpm-limit")
}

func TestContextsAndLoginErrors(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	env := newCLIEnv(t)

	// Not logged in: a clear error, no call.
	require.Contains(t, env.fail("org", "list"), "not logged in")
	// A wrong token is rejected by WhoAmI and nothing is saved.
	require.Contains(t, env.fail("login", "--server", server, "--token", "wrong"), "unauthenticated")
	_, err := os.Stat(env.config)
	require.ErrorIs(t, err, os.ErrNotExist)
	require.Contains(t, env.fail("login", "--server", "ftp://x", "--token", "t"), "want an http:// or https:// URL")

	env.ok("login", "--server", server, "--token", bootstrapToken)
	env.ok("login", "--server", server, "--token", bootstrapToken, "--context", "second")
	require.Equal(t, "second\n", env.ok("context", "current"))
	require.Contains(t, env.ok("context", "use", "default"), `Switched to context "default"`)
	require.Equal(t, "default\n", env.ok("context", "current"))
	require.Contains(t, env.fail("context", "use", "nope"), `context "nope" is not in`)
	require.Contains(t, env.fail("--context", "nope", "whoami"), `context "nope" is not in`)
	require.Equal(t, "bootstrap", env.okJSON("--context", "second", "whoami")["principal"])
	require.Contains(t, env.ok("context", "delete", "second"), "Deleted")

	var list []map[string]any
	require.NoError(t, json.Unmarshal([]byte(env.ok("context", "list", "-o", "json")), &list))
	require.Equal(t, []map[string]any{{"name": "default", "server": server, "current": true}}, list)

	// A group-readable config file gets a warning.
	require.NoError(t, os.Chmod(env.config, 0o644))
	r := env.run("context", "current")
	require.Equal(t, 0, r.code)
	require.Contains(t, r.stderr, "readable by others")

	// Help goes to stdout and succeeds.
	require.Contains(t, env.ok("help"), "Commands:")
	require.Contains(t, env.ok("key", "update", "-h"), "--rpm-limit N")
	require.Contains(t, env.fail("frobnicate"), `unknown command "frobnicate"`)
}

func TestAuditVerifyReportsABrokenChain(t *testing.T) {
	t.Parallel()
	server, dbURL := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	for _, name := range []string{"a", "b", "c"} {
		root.ok("org", "create", name)
	}
	require.Equal(t, "OK: 3 audit records checked, chain intact.\n", root.ok("audit", "verify"))
	// The server checks a bounded page per call; sluicectl walks them all.
	require.Equal(t, "OK: 3 audit records checked, chain intact.\n", root.ok("audit", "verify", "--page-size", "1"))
	require.Contains(t, root.fail("audit", "verify", "--page-size", "50001"), "--page-size must be between 1 and 50000")
	// An org token verifies its org's records only: the org's creation
	// and the token's, never the other orgs'.
	orgA := root.okJSON("org", "create", "--name", "d")["id"].(string)
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("-o", "json", "token", "create", "--scope", "org", "--org", orgA, "--role", "viewer", "--name", "d-viewer")), &created))
	orgView := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+created["token"].(string))
	require.Equal(t, "OK: 2 audit records checked, chain intact.\n", orgView.ok("audit", "verify"))
	require.Equal(t, "OK: 5 audit records checked, chain intact.\n", root.ok("audit", "verify"))

	// Edit record 2 behind the API's back (the append-only trigger is
	// bypassed the way a database superuser could).
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, `SET session_replication_role = replica`)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `UPDATE audit_log SET after_json = '{"name":"evil"}' WHERE seq = 2`)
	require.NoError(t, err)

	r := root.run("audit", "verify")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stdout, "BROKEN: record 2: ")
	require.Contains(t, r.stderr, "sluicectl: audit chain broken at seq 2: ")
	r = root.run("audit", "verify", "-o", "json")
	require.Equal(t, 1, r.code)
	var res map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &res))
	require.Equal(t, "2", res["broken_seq"])
	require.NotEmpty(t, res["problem"])
}
