package keyring

import (
	"bytes"
	"encoding/base64"
	"errors"
	"strings"
	"testing"
)

func key(b byte) string { return base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{b}, KeySize)) }

func TestSealOpenAndRotate(t *testing.T) {
	old, err := Parse("1:" + key(1))
	if err != nil {
		t.Fatal(err)
	}
	ct1 := old.Seal([]byte("secret-1"))
	both, err := Parse("2:" + key(2) + ",1:" + key(1))
	if err != nil {
		t.Fatal(err)
	}
	if both.Current() != 2 {
		t.Fatalf("current = %d", both.Current())
	}
	pt, err := both.Open(ct1)
	if err != nil || string(pt) != "secret-1" {
		t.Fatalf("old ciphertext after rotation: %q %v", pt, err)
	}
	ct2 := both.Seal([]byte("secret-2"))
	if !strings.HasPrefix(string(ct2), "v2:") {
		t.Fatalf("new ciphertext not under v2: %q", ct2[:3])
	}
	if _, err := old.Open(ct2); !errors.Is(err, ErrUnknownKey) {
		t.Fatalf("v2 ciphertext opened by a v1-only ring: %v", err)
	}
	tampered := append([]byte(nil), ct1...)
	tampered[len(tampered)-1] ^= 1
	if _, err := both.Open(tampered); err == nil {
		t.Fatal("tampered ciphertext opened")
	}
	wrong, _ := Parse("1:" + key(9))
	if _, err := wrong.Open(ct1); err == nil {
		t.Fatal("opened with the wrong key")
	}
}

func TestParseReportsEverything(t *testing.T) {
	_, err := Parse("x:" + key(1) + ",2:short,3:" + key(3) + ",3:" + key(3) + ",nocolon")
	if err == nil {
		t.Fatal("accepted")
	}
	for _, want := range []string{`version "x"`, "version 2: want 32 bytes", "given twice", "VERSION:BASE64KEY"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q missing %q", err, want)
		}
	}
}
