package wire

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

var update = flag.Bool("update", false, "rewrite the golden fixture of the current schema version")

// goldenSnapshots are the fixtures of every schema version, by version.
// Each is encoded in testdata/snapshot-v<N>.bin by the build that wrote
// that version and must keep decoding to the same message.
var goldenSnapshots = map[uint32]func() *configv1.Snapshot{
	1: goldenSnapshotV1,
	2: goldenSnapshotV2,
}

func goldenSnapshotV1() *configv1.Snapshot {
	at := timestamppb.New(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
	return &configv1.Snapshot{
		SchemaVersion: 1, Version: 7, CreatedAt: at, EventsSeq: 42,
		Orgs:  []*configv1.Org{{Id: "org_1", Limits: &configv1.Limits{RpmLimit: proto.Int64(100)}}},
		Teams: []*configv1.Team{{Id: "team_1", OrgId: "org_1", TrafficClass: configv1.TrafficClass_TRAFFIC_CLASS_AGENT, ModelGroupAliases: map[string]string{"qwen": "qwen-agents"}}},
		Users: []*configv1.User{{Id: "user_1", OrgId: "org_1", Blocked: true}},
		Members: []*configv1.Member{{TeamId: "team_1", UserId: "user_1", OrgId: "org_1", MaxBudgetInTeam: proto.Float64(5),
			Limits: &configv1.Limits{BudgetDuration: "30d"}}},
		Customers: []*configv1.Customer{{Id: "cus_1", OrgId: "org_1", ExternalId: "acme-customer"}},
		Keys: []*configv1.Key{{Id: "key_1", OrgId: "org_1", TeamId: "team_1", UserId: "user_1", Hash: make([]byte, 32), PepperVersion: 1,
			ExpireTime: at, Tags: []string{"a"}, OldHashes: []*configv1.OldHash{{Hash: make([]byte, 32), PepperVersion: 1, ValidUntil: at}}}},
	}
}

// goldenSnapshotV2 adds model groups and deployments.
func goldenSnapshotV2() *configv1.Snapshot {
	s := goldenSnapshotV1()
	s.SchemaVersion = 2
	s.ModelGroups = []*configv1.ModelGroup{{Name: "qwen"}, {Name: "qwen-agents"}}
	s.Deployments = []*configv1.Deployment{
		{Id: "dep_1", ModelGroup: "qwen", ApiBase: "http://vllm-a:8000/v1", UpstreamModel: "Qwen/Qwen3-30B-A3B",
			CredentialCiphertext: append([]byte("v1:"), make([]byte, 12+16+8)...), Weight: 3, MaxConcurrency: 64,
			Capabilities: &configv1.Capabilities{Tools: true, JsonMode: true, MaxInputTokens: 32768, MaxOutputTokens: 4096},
			Tags:         []string{"interactive"},
			Prices:       &configv1.Prices{InputPerToken: 2e-7, OutputPerToken: 8e-7, CachedInputPerToken: 1e-7}},
		{Id: "dep_2", ModelGroup: "qwen-agents", ApiBase: "http://vllm-b:8000/v1", UpstreamModel: "Qwen/Qwen3-30B-A3B",
			Weight: 1, Capabilities: &configv1.Capabilities{}, Prices: &configv1.Prices{}, Free: true},
	}
	return s
}

// TestGoldenSnapshotsDecode keeps every schema version's fixture decoding.
func TestGoldenSnapshotsDecode(t *testing.T) {
	if _, ok := goldenSnapshots[SchemaVersion]; !ok {
		t.Fatalf("no golden snapshot for schema version %d: add one (and its fixture with -update)", SchemaVersion)
	}
	for v := uint32(1); v <= SchemaVersion; v++ {
		golden := goldenSnapshots[v]
		if golden == nil {
			t.Errorf("no golden snapshot for schema version %d", v)
			continue
		}
		path := filepath.Join("testdata", fmt.Sprintf("snapshot-v%d.bin", v))
		if *update && v == SchemaVersion {
			body, _, err := EncodeSnapshot(golden())
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, body, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		body, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("read golden fixture (run go test ./proto/wire -update once): %v", err)
		}
		got, err := DecodeSnapshot(body, &configv1.SnapshotPointer{Version: 7, Digest: Digest(body)})
		if err != nil {
			t.Fatalf("schema version %d: %v", v, err)
		}
		if !proto.Equal(got, golden()) {
			t.Fatalf("golden snapshot of schema version %d decoded differently:\n%v", v, got)
		}
	}
}

func TestDecodeSnapshotRejects(t *testing.T) {
	body, digest, err := EncodeSnapshot(goldenSnapshotV2())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := DecodeSnapshot(body, &configv1.SnapshotPointer{Version: 7, Digest: make([]byte, 32)}); !errors.Is(err, ErrDigest) {
		t.Errorf("wrong digest: %v", err)
	}
	if _, err := DecodeSnapshot(body, &configv1.SnapshotPointer{Version: 8, Digest: digest}); err == nil {
		t.Error("version mismatch accepted")
	}
	junk := []byte{0xff, 0xff, 0xff}
	if _, err := DecodeSnapshot(junk, &configv1.SnapshotPointer{Version: 7, Digest: Digest(junk)}); err == nil {
		t.Error("undecodable accepted")
	}
	future := goldenSnapshotV2()
	future.SchemaVersion = SchemaVersion + 1
	fb, fd, _ := EncodeSnapshot(future)
	if _, err := DecodeSnapshot(fb, &configv1.SnapshotPointer{Version: 7, Digest: fd}); err == nil {
		t.Error("future schema accepted")
	}
}

func TestRegionNames(t *testing.T) {
	for _, ok := range []string{"default", "eu-west-1", "a"} {
		if !ValidRegion(ok) {
			t.Errorf("%q rejected", ok)
		}
	}
	for _, bad := range []string{"", "EU", "-a", "a-", "a.b", "a_b"} {
		if ValidRegion(bad) {
			t.Errorf("%q accepted", bad)
		}
	}
}
