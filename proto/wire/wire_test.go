package wire

import (
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

var update = flag.Bool("update", false, "rewrite the golden fixture of the current schema version")

func goldenSnapshot() *configv1.Snapshot {
	at := timestamppb.New(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
	return &configv1.Snapshot{
		SchemaVersion: SchemaVersion, Version: 7, CreatedAt: at, EventsSeq: 42,
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

// TestGoldenSnapshotsDecode keeps every schema version's fixture decoding.
func TestGoldenSnapshotsDecode(t *testing.T) {
	path := filepath.Join("testdata", "snapshot-v1.bin")
	if *update {
		body, _, err := EncodeSnapshot(goldenSnapshot())
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
		t.Fatal(err)
	}
	if !proto.Equal(got, goldenSnapshot()) {
		t.Fatalf("golden snapshot decoded differently:\n%v", got)
	}
}

func TestDecodeSnapshotRejects(t *testing.T) {
	body, digest, err := EncodeSnapshot(goldenSnapshot())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := DecodeSnapshot(body, &configv1.SnapshotPointer{Version: 7, Digest: make([]byte, 32)}); err != ErrDigest {
		t.Errorf("wrong digest: %v", err)
	}
	if _, err := DecodeSnapshot(body, &configv1.SnapshotPointer{Version: 8, Digest: digest}); err == nil {
		t.Error("version mismatch accepted")
	}
	junk := []byte{0xff, 0xff, 0xff}
	if _, err := DecodeSnapshot(junk, &configv1.SnapshotPointer{Version: 7, Digest: Digest(junk)}); err == nil {
		t.Error("undecodable accepted")
	}
	future := goldenSnapshot()
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
