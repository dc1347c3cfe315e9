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
