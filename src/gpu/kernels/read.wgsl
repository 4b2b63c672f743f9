// One read of the logits: every element summed once (the benchmarks' baseline). Each workgroup
// writes its partial sum; the host adds the `groups` partials.
struct P {
    n: u32,
    offset: u32,
    groups: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> prm: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

var<workgroup> sh: array<f32, 256>;

@compute @workgroup_size(256)
fn read_logits(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    var acc = 0.0;
    for (var i = wid.x * 256u + lid.x; i < prm.n; i += prm.groups * 256u) {
        acc = acc + x[prm.offset + i];
    }
    sh[lid.x] = acc;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (lid.x < s) {
            sh[lid.x] = sh[lid.x] + sh[lid.x + s];
        }
        workgroupBarrier();
    }
    if (lid.x == 0u) {
        out[wid.x] = sh[0];
    }
}
