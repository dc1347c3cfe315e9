package main

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// startProxy runs the built `sluice proxy` for region against natsURL and
// waits until it has loaded a configuration (/readyz answers 200); it
// returns the proxy's address.
func startProxy(t *testing.T, natsURL, region, instance string, extra ...string) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	var logs syncBuffer
	cmd := exec.Command(bins.sluice, append([]string{"proxy", "--addr", addr, "--region", region, "--instance-id", instance, "--nats-url", natsURL}, extra...)...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir(), "SLUICE_KEY_PEPPER=1:sluicectl-test-pepper-0123456789abcdef", "SLUICE_KEK=" + testKEK}
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
			t.Logf("sluice proxy %s output:\n%s", instance, logs.String())
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case err := <-exited:
			t.Fatalf("sluice proxy %s exited early (%v):\n%s", instance, err, logs.String())
		default:
		}
		resp, err := http.Get("http://" + addr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return addr
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("sluice proxy %s not ready within 30s:\n%s", instance, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// eventually runs sluicectl with args (and -o json) until cond accepts the
// decoded output, failing after 20 s with the last output.
func (e *cliEnv) eventually(cond func(out any) bool, args ...string) any {
	e.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		raw := e.ok(append(args, "-o", "json")...)
		var out any
		require.NoError(e.t, json.Unmarshal([]byte(raw), &out), "output of %v is not JSON:\n%s", args, raw)
		if cond(out) {
			return out
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("sluicectl %s: condition not met within 20s; last output:\n%s", strings.Join(args, " "), raw)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// u64 reads a uint64 field of protojson output (encoded as a string).
func u64(t *testing.T, m map[string]any, key string) uint64 {
	t.Helper()
	s, _ := m[key].(string)
	if s == "" {
		return 0
	}
	n, err := strconv.ParseUint(s, 10, 64)
	require.NoError(t, err, "%s = %q", key, s)
	return n
}

// regionStatus finds region in `rollout status -o json` output.
func regionStatus(t *testing.T, out any, region string) (map[string]any, []any) {
	t.Helper()
	regions, _ := out.(map[string]any)["regions"].([]any)
	for _, r := range regions {
		rs := r.(map[string]any)
		if reg := obj(t, rs, "region"); reg["name"] == region {
			planes, _ := rs["data_planes"].([]any)
			return reg, planes
		}
	}
	t.Fatalf("region %q not in rollout status %v", region, out)
	return nil, nil
}

func TestFleetAndRollout(t *testing.T) {
	t.Parallel()
	server, _, natsURL := startServerNATS(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)

	// Regions: a staged canary next to the default auto region.
	canary := root.okJSON("region", "upsert", "canary", "--policy", "staged")
	require.Equal(t, "canary", canary["name"])
	require.Equal(t, "ROLLOUT_POLICY_STAGED", canary["policy"])
	require.Contains(t, root.fail("region", "upsert", "eu"), "--policy is required: auto or staged")
	require.Contains(t, root.fail("region", "upsert", "eu", "--policy", "fast"), "want one of auto, staged")
	require.Contains(t, root.fail("region", "upsert", "Not_A_Region", "--policy", "auto"), "invalid_argument: ")

	startProxy(t, natsURL, "default", "dp-default")
	startProxy(t, natsURL, "canary", "dp-canary")

	// Both regions run a version (the canary's first), and the fleet view
	// shows both instances running them.
	var v0 uint64
	status := root.eventually(func(out any) bool {
		def, _ := regionStatus(t, out, "default")
		can, _ := regionStatus(t, out, "canary")
		v0 = u64(t, can, "current_version")
		return v0 > 0 && u64(t, def, "current_version") >= v0
	}, "rollout", "status")
	require.GreaterOrEqual(t, u64(t, obj(t, status.(map[string]any), "latest"), "version"), v0)
	root.eventually(func(out any) bool {
		planes := out.([]any)
		seen := map[string]bool{}
		for _, p := range planes {
			d := p.(map[string]any)
			seen[d["instance_id"].(string)+"/"+d["region"].(string)] = d["health"] == "ok" && u64(t, d, "applied_version") >= v0
		}
		return len(planes) == 2 && seen["dp-default/default"] && seen["dp-canary/canary"]
	}, "fleet", "list")
	var only []map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("fleet", "list", "--region", "canary", "-o", "json")), &only))
	require.Len(t, only, 1)
	require.Equal(t, "dp-canary", only[0]["instance_id"])
	fleetTable := root.ok("fleet", "list")
	require.Regexp(t, `(?m)^INSTANCE\s+REGION\s+VERSION\s+EVENTS SEQ\s+HEALTH`, fleetTable)
	require.Regexp(t, `(?m)^dp-canary\s+canary\s+`+strconv.FormatUint(v0, 10)+`\s`, fleetTable)

	// A change compiles a new version: the auto region takes it, the
	// staged canary keeps its version until promoted.
	root.ok("org", "create", "rollout-org")
	var v1 uint64
	root.eventually(func(out any) bool {
		def, _ := regionStatus(t, out, "default")
		v1 = u64(t, def, "current_version")
		return v1 > v0
	}, "rollout", "status")
	status = root.eventually(func(out any) bool {
		_, planes := regionStatus(t, out, "default")
		return len(planes) == 1 && u64(t, planes[0].(map[string]any), "applied_version") == v1
	}, "rollout", "status")
	can, _ := regionStatus(t, status, "canary")
	require.Equal(t, v0, u64(t, can, "current_version"), "a staged region waits for promotion")
	table := root.ok("rollout", "status")
	require.Regexp(t, `^Latest config version: \d+ \(events_seq \d+, \d+ bytes, compiled `, table)
	require.Regexp(t, `(?m)^REGION\s+POLICY\s+VERSION\s+INSTANCES\s+RUNNING`, table)
	require.Regexp(t, `(?m)^canary\s+staged\s+`+strconv.FormatUint(v0, 10)+`\s+1\s+v`+strconv.FormatUint(v0, 10)+`: 1\s`, table)

	// Promote the canary, then roll it back; its instance follows.
	promoted := root.okJSON("rollout", "promote", "canary", strconv.FormatUint(v1, 10))
	require.Equal(t, v1, u64(t, promoted, "current_version"))
	root.eventually(func(out any) bool {
		_, planes := regionStatus(t, out, "canary")
		return len(planes) == 1 && u64(t, planes[0].(map[string]any), "applied_version") == v1
	}, "rollout", "status")
	require.Regexp(t, `(?m)^current_version:\s+`+strconv.FormatUint(v0, 10)+`$`, root.ok("rollout", "rollback", "canary", strconv.FormatUint(v0, 10)))
	root.eventually(func(out any) bool {
		for _, p := range out.([]any) {
			if d := p.(map[string]any); d["instance_id"] == "dp-canary" {
				return u64(t, d, "applied_version") == v0
			}
		}
		return false
	}, "fleet", "list", "--region", "canary")

	// The server's rules come back as its errors; bad arguments fail
	// before any call.
	require.Contains(t, root.fail("rollout", "promote", "default", strconv.FormatUint(v0, 10)), "failed_precondition: ")
	require.Contains(t, root.fail("rollout", "rollback", "canary", strconv.FormatUint(v1, 10)), "failed_precondition: ")
	require.Contains(t, root.fail("rollout", "promote", "nowhere", strconv.FormatUint(v1, 10)), "not_found: ")
	require.Contains(t, root.fail("rollout", "promote", "canary", "latest"), `version "latest": want a config version number`)
	require.Contains(t, root.fail("rollout", "promote", "canary"), "missing argument")

	// The fleet is platform-wide: an org admin may not see it.
	orgID := root.okJSON("org", "create", "fleet-org")["id"].(string)
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("token", "create", "--scope", "org", "--org", orgID, "--role", "admin", "--name", "org-admin", "-o", "json")), &created))
	orgEnv := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+created["token"].(string))
	require.Contains(t, orgEnv.fail("fleet", "list"), "permission_denied: ")
	require.Contains(t, orgEnv.fail("region", "upsert", "eu", "--policy", "auto"), "permission_denied: ")
}

// TestFleetListShowsRejecting: a data plane whose region pointer names an
// older version than it runs (what a control plane on a database that lost
// its history used to publish) shows, once past --max-rejecting, as
// "rejecting control plane: version N < running M" in the fleet view.
func TestFleetListShowsRejecting(t *testing.T) {
	t.Parallel()
	server, _, natsURL := startServerNATS(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	nc, err := nats.Connect(natsURL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	pointer := func() (*configv1.SnapshotPointer, []byte) {
		kv, err := js.KeyValue(ctx, wire.PointerBucket)
		if err != nil {
			return nil, nil
		}
		e, err := kv.Get(ctx, wire.PointerKey("default"))
		if err != nil {
			return nil, nil
		}
		ptr := &configv1.SnapshotPointer{}
		require.NoError(t, proto.Unmarshal(e.Value(), ptr))
		return ptr, e.Value()
	}
	var first []byte
	var v0 uint64
	require.Eventually(t, func() bool {
		ptr, raw := pointer()
		first, v0 = raw, ptr.GetVersion()
		return ptr != nil
	}, 20*time.Second, 20*time.Millisecond)
	root.ok("org", "create", "rejecting-org")
	var v1 uint64
	require.Eventually(t, func() bool {
		ptr, _ := pointer()
		v1 = ptr.GetVersion()
		return v1 > v0
	}, 20*time.Second, 20*time.Millisecond)
	startProxy(t, natsURL, "default", "dp-rejecting", "--max-rejecting", "1s")
	root.eventually(func(out any) bool {
		planes := out.([]any)
		return len(planes) == 1 && u64(t, planes[0].(map[string]any), "applied_version") == v1
	}, "fleet", "list")

	kv, err := js.KeyValue(ctx, wire.PointerBucket)
	require.NoError(t, err)
	_, err = kv.Put(ctx, wire.PointerKey("default"), first)
	require.NoError(t, err)
	want := "rejecting control plane: version " + strconv.FormatUint(v0, 10) + " < running " + strconv.FormatUint(v1, 10)
	deadline := time.Now().Add(20 * time.Second)
	for {
		table := root.ok("fleet", "list")
		if strings.Contains(table, want) {
			require.Regexp(t, `(?m)^dp-rejecting\s+default\s+`+strconv.FormatUint(v1, 10)+`\s+\d+\s+`+want, table)
			break
		}
		require.False(t, time.Now().After(deadline), "fleet list never showed %q:\n%s", want, table)
		time.Sleep(200 * time.Millisecond)
	}
	var planes []map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("fleet", "list", "-o", "json")), &planes))
	rej := planes[0]["rejecting"].(map[string]any)
	require.Equal(t, "rejecting", planes[0]["health"])
	require.Equal(t, true, rej["past_bound"])
	require.Equal(t, strconv.FormatUint(v0, 10), rej["version"])
	require.Equal(t, strconv.FormatUint(v1, 10), rej["running_version"])
}
