package audit

import (
	"testing"
	"time"
)

func chain(n int) []*Record {
	var out []*Record
	prevSeq, prevHash := int64(0), ZeroHash
	for i := 0; i < n; i++ {
		r := &Record{At: time.Unix(1700000000, int64(i)*1000), Actor: "bootstrap", Action: ActionCreated, ObjectType: "org", ObjectID: "org_x", AfterJSON: `{"a":1}`}
		Seal(r, prevSeq, prevHash)
		prevSeq, prevHash = r.Seq, r.Hash
		out = append(out, r)
	}
	return out
}

func verify(rs []*Record) *Break {
	v := NewVerifier()
	for _, r := range rs {
		if b := v.Next(r); b != nil {
			return b
		}
	}
	last := rs[len(rs)-1]
	return v.End(last.Seq, last.Hash)
}

func TestChainVerifies(t *testing.T) {
	if b := verify(chain(5)); b != nil {
		t.Fatalf("clean chain broken: %+v", b)
	}
}

func TestChainDetectsEdit(t *testing.T) {
	rs := chain(5)
	rs[2].AfterJSON = `{"a":2}`
	if b := verify(rs); b == nil || b.Seq != 3 {
		t.Fatalf("edit: got %+v, want break at 3", b)
	}
}

func TestCanonicalJSON(t *testing.T) {
	got, err := CanonicalJSON([]byte(` {"b": 1, "a": {"d": [1, 2], "c": 1.50}} `))
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"a":{"c":1.50,"d":[1,2]},"b":1}`; got != want {
		t.Fatalf("got %s, want %s", got, want)
	}
}

func TestResumeVerifierContinuesAChain(t *testing.T) {
	rs := chain(6)
	v := ResumeVerifier(rs[2].Seq, rs[2].Hash)
	for _, r := range rs[3:] {
		if b := v.Next(r); b != nil {
			t.Fatalf("resumed chain broken: %+v", b)
		}
	}
	if b := v.End(rs[5].Seq, rs[5].Hash); b != nil || v.Checked() != 3 {
		t.Fatalf("end: %+v, checked %d", b, v.Checked())
	}
	// Resuming with another hash than the record's breaks at the next one.
	if b := ResumeVerifier(rs[2].Seq, rs[1].Hash).Next(rs[3]); b == nil || b.Seq != 4 {
		t.Fatalf("wrong resume hash: got %+v, want break at 4", b)
	}
}

func TestCheckAlone(t *testing.T) {
	rs := chain(4)
	for i, r := range rs {
		var pred []byte
		if i > 0 {
			pred = rs[i-1].Hash
		}
		if b := CheckAlone(r, pred); b != nil {
			t.Fatalf("record %d: %+v", r.Seq, b)
		}
	}
	if b := CheckAlone(rs[2], nil); b == nil || b.Seq != 2 {
		t.Fatalf("missing predecessor: %+v", b)
	}
	if b := CheckAlone(rs[2], rs[0].Hash); b == nil || b.Seq != 3 {
		t.Fatalf("wrong predecessor: %+v", b)
	}
	rs[3].Actor = "mallory"
	if b := CheckAlone(rs[3], rs[2].Hash); b == nil || b.Seq != 4 {
		t.Fatalf("edited record: %+v", b)
	}
}
